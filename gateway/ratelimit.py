"""Per-tenant rate limits, concurrency leases and token quotas, shared by all replicas in Redis.

Every check is one atomic Lua script, so concurrent replicas can never both take the last unit
of a limit:

- requests/minute: GCRA. `burst` extra requests may arrive at once; over any 60 s at most
  `rpm + burst` are admitted.
- tokens/minute, daily and monthly token quotas: `prompt_tokens + max_tokens` is reserved at
  admission in the current UTC minute/day/month window; `complete` refunds the unused part.
- concurrency: one lease per running request in a sorted set scored by expiry, so the leases of
  a replica that died expire by themselves.

Admission is all-or-nothing: when one check fails, nothing is reserved. All keys of a tenant
carry the `{tenant}` hash tag, so the scripts also run on Redis Cluster. Time is Redis server
time (`TIME`) unless the caller passes `now`, which tests do for determinism.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

logger = logging.getLogger(__name__)

DEFAULT_BURST = 10
DEFAULT_LEASE_TTL_S = 300.0
DEFAULT_RETRY_INTERVAL_S = 1.0
KEY_PREFIX = "conveyor:rl"
RESERVATION_TTL_S = 86_400.0
UNLIMITED = -1

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)

REASON_CODES = {
    "rate_limit_requests": "rate_limit_exceeded",
    "rate_limit_tokens": "rate_limit_exceeded",
    "concurrency": "rate_limit_exceeded",
    "daily_quota": "insufficient_quota",
    "monthly_quota": "insufficient_quota",
    "unavailable": "service_unavailable",
}

REASON_MESSAGES = {
    "rate_limit_requests": "Rate limit reached for requests per minute.",
    "rate_limit_tokens": "Rate limit reached for tokens per minute.",
    "concurrency": "Too many concurrent requests.",
    "daily_quota": "Daily token quota exceeded.",
    "monthly_quota": "Monthly token quota exceeded.",
    "unavailable": "Rate limiter unavailable.",
}


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None means unlimited. `burst` None takes the limiter's default."""

    tenant: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    daily_token_quota: int | None = None
    monthly_token_quota: int | None = None
    burst: int | None = None


@dataclass(frozen=True)
class Admission:
    """The answer to one `admit` call, with what the HTTP layer needs to tell the client."""

    allowed: bool
    reason: str | None = None
    retry_after: float = 0.0
    degraded: bool = False
    reserved_tokens: int = 0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None

    @property
    def code(self) -> str | None:
        """OpenAI error code for the refusal body."""
        return REASON_CODES.get(self.reason) if self.reason else None

    @property
    def http_status(self) -> int:
        if self.allowed:
            return 200
        return 503 if self.reason == "unavailable" else 429

    @property
    def message(self) -> str:
        if self.allowed:
            return ""
        retry = f" Please retry after {format_reset(self.retry_after)}."
        return REASON_MESSAGES.get(self.reason or "", "Request refused.") + retry

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-reset-requests"] = format_reset(self.reset_requests or 0.0)
        if self.limit_tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = format_reset(self.reset_tokens or 0.0)
        if not self.allowed:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return headers


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI's headers write it (Go style): "120ms", "1s", "1.5s", "6m0s"."""
    total_ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    secs = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def hash_tag(tenant: str) -> str:
    """The tenant as a Redis Cluster hash tag; braces are escaped so the tag stays whole."""
    if not tenant:
        return "{%}"  # "{}" would not be a tag; a bare "%" is no escape's output
    escaped = tenant.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return "{" + escaped + "}"


@dataclass(frozen=True)
class TenantKeys:
    """Every Redis key used for one tenant; they all share the tenant's hash tag."""

    base: str

    @classmethod
    def of(cls, tenant: str, prefix: str = KEY_PREFIX) -> TenantKeys:
        return cls(f"{prefix}:{hash_tag(tenant)}")

    @property
    def gcra(self) -> str:
        return f"{self.base}:gcra"

    @property
    def tokens_minute(self) -> str:
        return f"{self.base}:tpm"

    @property
    def tokens_day(self) -> str:
        return f"{self.base}:day"

    @property
    def tokens_month(self) -> str:
        return f"{self.base}:month"

    @property
    def leases(self) -> str:
        return f"{self.base}:leases"

    def reservation(self, request_id: str) -> str:
        return f"{self.base}:res:{request_id}"


# --- Lua ---------------------------------------------------------------------------------------
# Window counters are hashes {w = window id, n = tokens}; a counter whose window id is not the
# current one counts as empty, so no key name depends on the clock and TTLs only collect garbage.

LUA_PRELUDE = """
local MINUTE_MS = 60000
local DAY_MS = 86400000
local EPSILON = 1e-6

local function clock_ms(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end

-- days since 1970-01-01 -> year, month (Howard Hinnant's civil_from_days)
local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400 + (month <= 2 and 1 or 0)
  return year, month
end

-- first day of (year, month) -> days since 1970-01-01
local function days_from_civil(year, month)
  if month <= 2 then year = year - 1 end
  local era = math.floor(year / 400)
  local yoe = year - era * 400
  local doy = math.floor((153 * ((month + 9) % 12) + 2) / 5)
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end

-- UTC month id and ms until the next month starts
local function month_window(now)
  local year, month = civil_from_days(math.floor(now / DAY_MS))
  local next_year, next_month = year, month + 1
  if next_month == 13 then next_year, next_month = year + 1, 1 end
  return year * 12 + month - 1, days_from_civil(next_year, next_month) * DAY_MS - now
end

local function window_used(key, window)
  local stored = redis.call('HMGET', key, 'w', 'n')
  if tonumber(stored[1]) ~= window then return 0 end
  return tonumber(stored[2]) or 0
end

-- GCRA: ok, retry ms, requests admissible right now, theoretical arrival time
local function gcra_state(key, rpm, burst, now)
  if rpm < 0 then return true, 0, -1, now end
  if rpm == 0 then return false, MINUTE_MS, 0, now + MINUTE_MS end
  local interval = MINUTE_MS / rpm
  local tolerance = burst * interval
  local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
  local remaining = math.max(0, math.floor((now + tolerance - tat) / interval + EPSILON) + 1)
  local wait = tat - tolerance - now
  if wait > EPSILON then return false, wait, 0, tat end
  return true, 0, remaining, tat
end
"""

ADMIT_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: gcra, tpm, day, month, leases, reservation
-- ARGV: now ms ('' = server time), rpm, burst, tpm, daily, monthly, max concurrency,
--       cost, request id, lease ttl ms, reservation ttl ms, concurrency retry ms
--       (a limit of -1 means unlimited)
local now = clock_ms(ARGV[1])
local rpm, burst, tpm = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local daily, monthly, max_concurrency = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local cost, request_id = tonumber(ARGV[8]), ARGV[9]
local lease_ttl, reservation_ttl = tonumber(ARGV[10]), tonumber(ARGV[11])
local concurrency_retry = tonumber(ARGV[12])

local minute = math.floor(now / MINUTE_MS)
local day = math.floor(now / DAY_MS)
local month, month_reset = month_window(now)
local minute_reset = (minute + 1) * MINUTE_MS - now
local day_reset = (day + 1) * DAY_MS - now

local function fits(limit, used)
  return limit < 0 or used + cost <= limit
end

local requests_ok, requests_wait, requests_remaining, tat = gcra_state(KEYS[1], rpm, burst, now)
local minute_used = window_used(KEYS[2], minute)
local day_used = window_used(KEYS[3], day)
local month_used = window_used(KEYS[4], month)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
local num_leases = redis.call('ZCARD', KEYS[5])

local function answer(allowed, reason, wait, remaining_requests, requests_reset, used_tokens)
  local remaining_tokens = tpm < 0 and -1 or math.max(0, tpm - used_tokens)
  return {allowed, reason, math.ceil(wait), remaining_requests, math.ceil(requests_reset),
    remaining_tokens, math.ceil(minute_reset)}
end
local function refuse(reason, wait)
  return answer(0, reason, wait, requests_remaining, math.max(0, tat - now), minute_used)
end

if not fits(monthly, month_used) then return refuse('monthly_quota', month_reset) end
if not fits(daily, day_used) then return refuse('daily_quota', day_reset) end
if not requests_ok then return refuse('rate_limit_requests', requests_wait) end
if not fits(tpm, minute_used) then return refuse('rate_limit_tokens', minute_reset) end
if max_concurrency >= 0 and num_leases >= max_concurrency then
  return refuse('concurrency', concurrency_retry)
end

local requests_reset = 0
if rpm > 0 then
  local new_tat = tat + MINUTE_MS / rpm
  requests_reset = new_tat - now
  redis.call('SET', KEYS[1], string.format('%.3f', new_tat), 'PX',
    math.ceil(requests_reset) + MINUTE_MS)
  requests_remaining = requests_remaining - 1
end
redis.call('HSET', KEYS[2], 'w', minute, 'n', minute_used + cost)
redis.call('PEXPIRE', KEYS[2], math.ceil(minute_reset) + MINUTE_MS)
redis.call('HSET', KEYS[3], 'w', day, 'n', day_used + cost)
redis.call('PEXPIRE', KEYS[3], math.ceil(day_reset) + DAY_MS)
redis.call('HSET', KEYS[4], 'w', month, 'n', month_used + cost)
redis.call('PEXPIRE', KEYS[4], math.ceil(month_reset) + DAY_MS)
redis.call('ZADD', KEYS[5], string.format('%.3f', now + lease_ttl), request_id)
redis.call('PEXPIRE', KEYS[5], lease_ttl + MINUTE_MS)
redis.call('HSET', KEYS[6], 'w', minute, 'd', day, 'm', month, 'n', cost)
redis.call('PEXPIRE', KEYS[6], reservation_ttl)
return answer(1, '', 0, requests_remaining, requests_reset, minute_used + cost)
"""
)

COMPLETE_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: tpm, day, month, leases, reservation
-- ARGV: reserved tokens, used tokens, request id
redis.call('ZREM', KEYS[4], ARGV[3])
local record = redis.call('HMGET', KEYS[5], 'w', 'd', 'm', 'n')
if not record[4] then return 0 end
redis.call('DEL', KEYS[5])
local refund = math.min(tonumber(record[4]), tonumber(ARGV[1])) - tonumber(ARGV[2])
if refund <= 0 then return 0 end

-- a window that has rolled over since admission keeps its fresh count
local function give_back(key, window)
  local used = window_used(key, window)
  if used > 0 then redis.call('HSET', key, 'n', math.max(0, used - refund)) end
end
give_back(KEYS[1], tonumber(record[1]))
give_back(KEYS[2], tonumber(record[2]))
give_back(KEYS[3], tonumber(record[3]))
return refund
"""
)

RENEW_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: leases; ARGV: now ms ('' = server time), lease ttl ms, request id
local now = clock_ms(ARGV[1])
local expiry = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[3]))
if not expiry then return 0 end
if expiry <= now then
  redis.call('ZREM', KEYS[1], ARGV[3])
  return 0
end
local lease_ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', string.format('%.3f', now + lease_ttl), ARGV[3])
redis.call('PEXPIRE', KEYS[1], lease_ttl + MINUTE_MS)
return 1
"""
)

USAGE_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: gcra, tpm, day, month, leases; ARGV: now ms ('' = server time), rpm, burst
local now = clock_ms(ARGV[1])
local minute = math.floor(now / MINUTE_MS)
local month = month_window(now)
local _, _, requests_remaining, tat = gcra_state(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3]), now)
return {
  requests_remaining,
  math.ceil(math.max(0, tat - now)),
  window_used(KEYS[2], minute),
  math.ceil((minute + 1) * MINUTE_MS - now),
  window_used(KEYS[3], math.floor(now / DAY_MS)),
  window_used(KEYS[4], month),
  redis.call('ZCOUNT', KEYS[5], '(' .. string.format('%.3f', now), '+inf'),
}
"""
)


class LuaScript:
    """A script called by EVALSHA; loaded (SCRIPT LOAD) on first use and again after NOSCRIPT."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def load(self, redis: aioredis.Redis) -> None:
        await redis.script_load(self.source)

    async def __call__(self, redis: aioredis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.load(redis)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)


ADMIT = LuaScript(ADMIT_LUA)
COMPLETE = LuaScript(COMPLETE_LUA)
RENEW = LuaScript(RENEW_LUA)
USAGE = LuaScript(USAGE_LUA)


class RedisUnavailable(Exception):
    """Redis failed recently; calls skip it until the retry interval has passed."""


def limit_arg(limit: int | None) -> int:
    return UNLIMITED if limit is None else max(0, int(limit))


def now_arg(now: float | None) -> str:
    """Milliseconds for the scripts; '' lets the script read the Redis server's clock."""
    return "" if now is None else f"{now * 1000:.3f}"


def decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def optional(value: int) -> int | None:
    return None if value < 0 else value


class RateLimiter:
    """Admits or refuses requests against a tenant's limits; never raises to the caller.

    `on_error` decides while Redis is unreachable: "open" admits (Admission.degraded is set),
    "closed" refuses with reason "unavailable". After a failure Redis is left alone for
    `retry_interval_s`, so an outage costs one timeout per interval instead of one per request.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        burst: int = DEFAULT_BURST,
        on_error: Literal["open", "closed"] = "open",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        concurrency_retry_s: float = 1.0,
        key_prefix: str = KEY_PREFIX,
    ) -> None:
        if on_error not in ("open", "closed"):
            raise ValueError(f"on_error must be 'open' or 'closed', not {on_error!r}")
        self.redis = redis
        self.burst = burst
        self.on_error = on_error
        self.lease_ttl_s = lease_ttl_s
        self.retry_interval_s = retry_interval_s
        self.concurrency_retry_s = concurrency_retry_s
        self.key_prefix = key_prefix
        self._skip_redis_until = 0.0

    def keys(self, tenant: str) -> TenantKeys:
        return TenantKeys.of(tenant, self.key_prefix)

    def burst_of(self, limits: TenantLimits) -> int:
        return max(0, self.burst if limits.burst is None else limits.burst)

    async def load_scripts(self) -> bool:
        """Load every script now (optional: calls load them on demand). False if Redis is down."""
        try:
            for script in (ADMIT, COMPLETE, RENEW, USAGE):
                await self._run(script.load(self.redis))
        except REDIS_ERRORS + (RedisUnavailable,):
            return False
        return True

    async def admit(
        self,
        limits: TenantLimits,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None = None,
    ) -> Admission:
        """Check every limit and, only if all pass, reserve prompt + max tokens and a lease."""
        cost = max(0, prompt_tokens) + max(0, max_tokens)
        keys = self.keys(limits.tenant)
        key_list = [keys.gcra, keys.tokens_minute, keys.tokens_day, keys.tokens_month]
        key_list += [keys.leases, keys.reservation(request_id)]
        args = [now_arg(now), limit_arg(limits.rpm), self.burst_of(limits)]
        args += [limit_arg(limits.tpm), limit_arg(limits.daily_token_quota)]
        args += [limit_arg(limits.monthly_token_quota), limit_arg(limits.max_concurrency)]
        args += [cost, request_id, round(self.lease_ttl_s * 1000)]
        args += [round(RESERVATION_TTL_S * 1000), round(self.concurrency_retry_s * 1000)]
        try:
            reply = await self._run(ADMIT(self.redis, key_list, args))
        except REDIS_ERRORS + (RedisUnavailable,) as error:
            return self._admission_without_redis(error)
        return self._admission_from_reply(limits, cost, reply)

    def _admission_from_reply(self, limits: TenantLimits, cost: int, reply: list) -> Admission:
        allowed, reason, wait_ms, requests_left, requests_reset_ms, tokens_left, tokens_reset_ms = (
            reply
        )
        has_rpm = limits.rpm is not None
        has_tpm = limits.tpm is not None
        return Admission(
            allowed=bool(allowed),
            reason=decode(reason) or None,
            retry_after=max(int(wait_ms), 1) / 1000 if not allowed else 0.0,
            reserved_tokens=cost if allowed else 0,
            limit_requests=limits.rpm,
            remaining_requests=int(requests_left) if has_rpm else None,
            reset_requests=int(requests_reset_ms) / 1000 if has_rpm else None,
            limit_tokens=limits.tpm,
            remaining_tokens=int(tokens_left) if has_tpm else None,
            reset_tokens=int(tokens_reset_ms) / 1000 if has_tpm else None,
        )

    def _admission_without_redis(self, error: BaseException) -> Admission:
        if self.on_error == "open":
            return Admission(allowed=True, degraded=True)
        return Admission(
            allowed=False,
            reason="unavailable",
            retry_after=max(self.retry_interval_s, 1.0),
            degraded=True,
        )

    async def complete(
        self, limits: TenantLimits, request_id: str, reserved_tokens: int, used_tokens: int
    ) -> None:
        """Release the request's lease and refund `reserved_tokens - used_tokens`.

        Refunds go to the windows the reservation was made in, and only while they are still
        current; calling it twice refunds once. If Redis is down the refund is lost (the tenant
        is charged its reservation) and the lease expires after `lease_ttl_s`.
        """
        keys = self.keys(limits.tenant)
        key_list = [keys.tokens_minute, keys.tokens_day, keys.tokens_month, keys.leases]
        key_list.append(keys.reservation(request_id))
        args = [max(0, reserved_tokens), max(0, used_tokens), request_id]
        try:
            await self._run(COMPLETE(self.redis, key_list, args))
        except REDIS_ERRORS + (RedisUnavailable,):
            return

    async def renew(self, limits: TenantLimits, request_id: str, now: float | None = None) -> bool:
        """Extend a running request's lease by `lease_ttl_s`; False if it had already expired
        (or Redis is unreachable). Long requests call it well within every `lease_ttl_s`."""
        keys = self.keys(limits.tenant)
        args = [now_arg(now), round(self.lease_ttl_s * 1000), request_id]
        try:
            return bool(await self._run(RENEW(self.redis, [keys.leases], args)))
        except REDIS_ERRORS + (RedisUnavailable,):
            return False

    async def usage(self, limits: TenantLimits, now: float | None = None) -> dict[str, Any]:
        """Tokens used today and this month (UTC) and the live rpm/tpm/concurrency state."""
        keys = self.keys(limits.tenant)
        key_list = [keys.gcra, keys.tokens_minute, keys.tokens_day, keys.tokens_month]
        key_list.append(keys.leases)
        args = [now_arg(now), limit_arg(limits.rpm), self.burst_of(limits)]
        try:
            reply = await self._run(USAGE(self.redis, key_list, args))
        except REDIS_ERRORS + (RedisUnavailable,):
            return {"tenant": limits.tenant, "available": False}
        return usage_from_reply(limits, [int(value) for value in reply])

    async def _run(self, call: Any) -> Any:
        """Await a Redis call unless Redis failed within the last `retry_interval_s`."""
        if time.monotonic() < self._skip_redis_until:
            call.close()
            raise RedisUnavailable
        try:
            return await call
        except REDIS_ERRORS as error:
            self._skip_redis_until = time.monotonic() + self.retry_interval_s
            logger.warning("rate limiter: Redis unavailable (%s: %s)", type(error).__name__, error)
            raise


def remaining(limit: int | None, used: int) -> int | None:
    return None if limit is None else max(0, limit - used)


def usage_from_reply(limits: TenantLimits, reply: list[int]) -> dict[str, Any]:
    requests_left, requests_reset_ms, minute_used, minute_reset_ms = reply[:4]
    day_used, month_used, num_leases = reply[4:]
    return {
        "tenant": limits.tenant,
        "available": True,
        "tokens_today": day_used,
        "tokens_this_month": month_used,
        "daily_tokens_remaining": remaining(limits.daily_token_quota, day_used),
        "monthly_tokens_remaining": remaining(limits.monthly_token_quota, month_used),
        "requests_remaining": optional(requests_left),
        "requests_reset_s": requests_reset_ms / 1000,
        "tokens_this_minute": minute_used,
        "tokens_remaining": remaining(limits.tpm, minute_used),
        "tokens_reset_s": minute_reset_ms / 1000,
        "concurrency": num_leases,
        "max_concurrency": limits.max_concurrency,
    }
