"""Per-tenant rate limits, concurrency leases and token quotas, shared by all replicas in Redis.

Every check is one atomic Lua script, so concurrent replicas can never both take the last unit
of a limit:

- requests/minute: a sliding-window log (see `limit_scripts`): in any 60 s at most
  `rpm + burst` requests are admitted (burst is per tenant, 0 unless set). A check costs
  O(log N) amortised, O(N) at worst (N: admissions in the last 60 s, at most the limit).
- tokens/minute: the same sliding window over tokens; daily and monthly token quotas: the
  current UTC day/month. `prompt_tokens + max_tokens` is reserved at admission; `complete`
  refunds the unused part.
- concurrency: one lease per running request in a sorted set scored by expiry, so the leases of
  a replica that died expire by themselves.

Admission is all-or-nothing: when one check fails, nothing is reserved. All keys of a tenant
carry the `{tenant}` hash tag, so the scripts also run on Redis Cluster. Time is Redis server
time (`TIME`) unless the caller passes `now`, which tests do for determinism.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.tenancy.limit_answers import Admission, admission_from_reply, format_reset  # noqa: F401
from gateway.tenancy.limit_scopes import RequestLimits, ScopedLimits, as_request_limits
from gateway.tenancy.limit_scripts import ADMIT, COMPLETE, RENEW, USAGE
from gateway.tenancy.limits import LIMIT_FIELDS, SCRIPT_LIMIT_FIELDS, LimitField

logger = logging.getLogger(__name__)


DEFAULT_LEASE_TTL_S = 300.0


DEFAULT_RETRY_INTERVAL_S = 1.0


KEY_PREFIX = "conveyor:rl"


RESERVATION_TTL_S = 86_400.0


UNLIMITED = -1


REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


TenantLimits = make_dataclass(
    "TenantLimits",
    [("tenant", str)]
    + [(limit.name, int | None, field(default=limit.default)) for limit in LIMIT_FIELDS],
    frozen=True,
)
TenantLimits.__doc__ = "One tenant's limits (the fields of `limits.LIMIT_FIELDS`); None: unlimited."
TenantLimits.__module__ = __name__  # picklable (replicas in tests are processes)


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
    def requests(self) -> str:
        return f"{self.base}:rpm"

    @property
    def tokens_log(self) -> str:
        return f"{self.base}:tpm"

    @property
    def token_costs(self) -> str:
        return f"{self.base}:tpm:cost"

    @property
    def tokens_sum(self) -> str:
        return f"{self.base}:tpm:sum"

    @property
    def tokens(self) -> list[str]:
        """The sliding window over tokens: log, costs, sum."""
        return [self.tokens_log, self.token_costs, self.tokens_sum]

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


class RedisUnavailable(Exception):
    """Redis failed recently; calls skip it until the retry interval has passed."""


def limit_arg(limit: LimitField, value: int | None) -> int:
    if value is None:
        return UNLIMITED if limit.nullable else int(limit.default or 0)
    return max(0, int(value))


def limit_args(limits: TenantLimits) -> list[int]:
    """The limits as the scripts take them: in the order of `SCRIPT_LIMIT_FIELDS`, -1 =
    unlimited."""
    return [limit_arg(limit, getattr(limits, limit.name)) for limit in SCRIPT_LIMIT_FIELDS]


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
        on_error: Literal["open", "closed"] = "open",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        concurrency_retry_s: float = 1.0,
        key_prefix: str = KEY_PREFIX,
    ) -> None:
        if on_error not in ("open", "closed"):
            raise ValueError(f"on_error must be 'open' or 'closed', not {on_error!r}")
        self.redis = redis
        self.on_error = on_error
        self.lease_ttl_s = lease_ttl_s
        self.retry_interval_s = retry_interval_s
        self.concurrency_retry_s = concurrency_retry_s
        self.key_prefix = key_prefix
        self._skip_redis_until = 0.0

    def keys(self, tenant: str) -> TenantKeys:
        return TenantKeys.of(tenant, self.key_prefix)

    async def load_scripts(self) -> bool:
        """Load every script now (optional: calls load them on demand). False if Redis is down."""
        try:
            for script in (ADMIT, COMPLETE, RENEW, USAGE):
                await self._run(script.load(self.redis))
        except REDIS_ERRORS + (RedisUnavailable,):
            return False
        return True

    def scope_keys(self, limits: RequestLimits, scope: ScopedLimits) -> TenantKeys:
        return TenantKeys(self.keys(limits.tenant).base + scope.suffix)

    async def admit(
        self,
        limits: TenantLimits | RequestLimits,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None = None,
    ) -> Admission:
        """Check every limit of every set and, only if all pass, reserve prompt + max tokens and
        a lease in each."""
        limits = as_request_limits(limits)
        cost = max(0, prompt_tokens) + max(0, max_tokens)
        key_list = [self.keys(limits.tenant).reservation(request_id)]
        args = [now_arg(now), cost, request_id, round(self.lease_ttl_s * 1000),
                round(RESERVATION_TTL_S * 1000), round(self.concurrency_retry_s * 1000),
                len(limits.scopes)]  # fmt: skip
        for scope in limits.scopes:
            keys = self.scope_keys(limits, scope)
            key_list += [keys.requests, *keys.tokens, keys.tokens_day, keys.tokens_month]
            key_list.append(keys.leases)
            args += limit_args(scope.limits)
        try:
            reply = await self._run(ADMIT(self.redis, key_list, args))
        except REDIS_ERRORS + (RedisUnavailable,) as error:
            return self._admission_without_redis(error)
        return admission_from_reply(limits, cost, reply)

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
        self,
        limits: TenantLimits | RequestLimits,
        request_id: str,
        reserved_tokens: int,
        used_tokens: int,
    ) -> None:
        """Release the request's leases and refund `reserved_tokens - used_tokens` in every set.

        Refunds go to the windows the reservation was made in, and only while they are still
        current; calling it twice refunds once. If Redis is down the refund is lost (the tenant
        is charged its reservation) and the leases expire after `lease_ttl_s`.
        """
        limits = as_request_limits(limits)
        key_list = [self.keys(limits.tenant).reservation(request_id)]
        for scope in limits.scopes:
            keys = self.scope_keys(limits, scope)
            key_list += [*keys.tokens, keys.tokens_day, keys.tokens_month, keys.leases]
        args = [max(0, reserved_tokens), max(0, used_tokens), request_id]
        try:
            await self._run(COMPLETE(self.redis, key_list, args))
        except REDIS_ERRORS + (RedisUnavailable,):
            return

    async def renew(
        self, limits: TenantLimits | RequestLimits, request_id: str, now: float | None = None
    ) -> bool:
        """Extend a running request's leases by `lease_ttl_s`; False if one had already expired
        (or Redis is unreachable). Long requests call it well within every `lease_ttl_s`."""
        limits = as_request_limits(limits)
        key_list = [self.scope_keys(limits, scope).leases for scope in limits.scopes]
        args = [now_arg(now), round(self.lease_ttl_s * 1000), request_id]
        try:
            return bool(await self._run(RENEW(self.redis, key_list, args)))
        except REDIS_ERRORS + (RedisUnavailable,):
            return False

    async def usage(self, limits: TenantLimits, now: float | None = None) -> dict[str, Any]:
        """Tokens used today and this month (UTC) and the live rpm/tpm/concurrency state."""
        keys = self.keys(limits.tenant)
        key_list = [keys.requests, *keys.tokens, keys.tokens_day, keys.tokens_month, keys.leases]
        args = [now_arg(now), *limit_args(limits)]
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
