"""The Lua scripts behind `RateLimiter`: each check, reservation, refund and lease renewal is one
atomic script, run by its SHA (loaded once, reloaded after a Redis restart). The same scripts run
on real Redis and on fakeredis (the embedded default).

Requests and tokens per minute are sliding-window logs: a sorted set of the admissions of the
last 60 s scored by admission time (plus, for tokens, each admission's reserved cost and their
running sum). A request is admitted only if the admissions in (now - 60 s, now] plus itself stay
within the limit, so no 60-second window ever holds more than the limit, and a client that keeps
to it (evenly, or all at once at the top of a window) is never refused. Cost per check: O(log N)
amortised (each admission is added once and removed once; N = admissions in the window, at
most the limit), O(N) worst case when computing how long a refused client must wait for tokens;
memory O(N) per tenant.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

LUA_PRELUDE = """
local WINDOW_MS = 60000  -- the rate-limit window: any 60 s
local DAY_MS = 86400000

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

local function score(ms) return string.format('%.3f', ms) end

-- Requests: a sliding-window log, one sorted-set member per admitted request scored by its
-- admission time. An admission is in the window while now - WINDOW_MS < its time.
local function requests_in_window(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', score(now - WINDOW_MS))
  return redis.call('ZCARD', key)
end

-- ms until one more request fits under `capacity` with `count` in the window
local function wait_for_request(key, now, count, capacity)
  local must_leave = count - capacity  -- 0-based rank of the admission whose exit frees a slot
  if must_leave < 0 then return 0 end
  local entry = redis.call('ZRANGE', key, must_leave, must_leave, 'WITHSCORES')
  return math.max(0, tonumber(entry[2]) + WINDOW_MS - now)
end

-- Tokens: the same log (KEYS log), each request's reserved cost in a hash (KEYS costs) and
-- their sum (KEYS sum), kept up to date as admissions leave the window and refunds come in.
local function tokens_in_window(log, costs, sum_key, now)
  local expired = redis.call('ZRANGEBYSCORE', log, '-inf', score(now - WINDOW_MS))
  local sum = tonumber(redis.call('GET', sum_key)) or 0
  if #expired == 0 then return sum end
  for _, id in ipairs(expired) do
    sum = sum - (tonumber(redis.call('HGET', costs, id)) or 0)
    redis.call('HDEL', costs, id)
  end
  redis.call('ZREMRANGEBYSCORE', log, '-inf', score(now - WINDOW_MS))
  sum = math.max(0, sum)
  redis.call('SET', sum_key, sum, 'PX', 2 * WINDOW_MS)
  return sum
end

-- ms until `cost` more tokens fit under `limit` with `sum` in the window
local function wait_for_tokens(log, costs, now, sum, cost, limit)
  if sum + cost <= limit then return 0 end
  if cost > limit then return WINDOW_MS end  -- never fits; the refusal says so
  local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
  local freed = 0
  for i = 1, #entries, 2 do
    freed = freed + (tonumber(redis.call('HGET', costs, entries[i])) or 0)
    if sum - freed + cost <= limit then
      return math.max(0, tonumber(entries[i + 1]) + WINDOW_MS - now)
    end
  end
  return WINDOW_MS
end

local function log_tokens(log, costs, sum_key, now, request_id, cost, sum)
  redis.call('ZADD', log, score(now), request_id)
  redis.call('HSET', costs, request_id, cost)
  redis.call('SET', sum_key, sum + cost)
  for _, key in ipairs({log, costs, sum_key}) do redis.call('PEXPIRE', key, 2 * WINDOW_MS) end
end
"""


ADMIT_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: requests log, tokens log, token costs, tokens sum, day, month, leases, reservation
-- ARGV: now ms ('' = server time), then the limits in the order of limits.SCRIPT_LIMIT_FIELDS
--       (rpm, burst, tpm, max concurrency, daily, monthly; -1 = unlimited),
--       then cost, request id, lease ttl ms, reservation ttl ms, concurrency retry ms
local now = clock_ms(ARGV[1])
local rpm, burst, tpm = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local max_concurrency, daily, monthly = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local cost, request_id = tonumber(ARGV[8]), ARGV[9]
local lease_ttl, reservation_ttl = tonumber(ARGV[10]), tonumber(ARGV[11])
local concurrency_retry = tonumber(ARGV[12])

local day = math.floor(now / DAY_MS)
local month, month_reset = month_window(now)
local day_reset = (day + 1) * DAY_MS - now

local function fits(limit, used)
  return limit < 0 or used + cost <= limit
end

local capacity = rpm < 0 and -1 or rpm + burst
local num_requests = rpm < 0 and 0 or requests_in_window(KEYS[1], now)
local tokens_used = tpm < 0 and 0 or tokens_in_window(KEYS[2], KEYS[3], KEYS[4], now)
local day_used = window_used(KEYS[5], day)
local month_used = window_used(KEYS[6], month)
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
local num_leases = redis.call('ZCARD', KEYS[7])

local function requests_state(count)
  if capacity < 0 then return -1, 0 end
  return math.max(0, capacity - count), wait_for_request(KEYS[1], now, count, capacity)
end
local function tokens_state(used)
  if tpm < 0 then return -1, 0 end
  return math.max(0, tpm - used), wait_for_tokens(KEYS[2], KEYS[3], now, used, 1, tpm)
end
local function answer(allowed, reason, wait, count, used)
  local requests_left, requests_reset = requests_state(count)
  local tokens_left, tokens_reset = tokens_state(used)
  return {allowed, reason, math.ceil(wait), requests_left, math.ceil(requests_reset),
    tokens_left, math.ceil(tokens_reset)}
end
local function refuse(reason, wait)
  return answer(0, reason, wait, num_requests, tokens_used)
end

if not fits(monthly, month_used) then return refuse('monthly_quota', month_reset) end
if not fits(daily, day_used) then return refuse('daily_quota', day_reset) end
if capacity >= 0 and num_requests >= capacity then
  return refuse('rate_limit_requests', wait_for_request(KEYS[1], now, num_requests, capacity))
end
if not fits(tpm, tokens_used) then
  return refuse('rate_limit_tokens', wait_for_tokens(KEYS[2], KEYS[3], now, tokens_used, cost, tpm))
end
if max_concurrency >= 0 and num_leases >= max_concurrency then
  return refuse('concurrency', concurrency_retry)
end

if capacity >= 0 then
  redis.call('ZADD', KEYS[1], score(now), request_id)
  redis.call('PEXPIRE', KEYS[1], 2 * WINDOW_MS)
end
if tpm >= 0 then log_tokens(KEYS[2], KEYS[3], KEYS[4], now, request_id, cost, tokens_used) end
redis.call('HSET', KEYS[5], 'w', day, 'n', day_used + cost)
redis.call('PEXPIRE', KEYS[5], math.ceil(day_reset) + DAY_MS)
redis.call('HSET', KEYS[6], 'w', month, 'n', month_used + cost)
redis.call('PEXPIRE', KEYS[6], math.ceil(month_reset) + DAY_MS)
redis.call('ZADD', KEYS[7], score(now + lease_ttl), request_id)
redis.call('PEXPIRE', KEYS[7], lease_ttl + WINDOW_MS)
redis.call('HSET', KEYS[8], 'd', day, 'm', month, 'n', cost)
redis.call('PEXPIRE', KEYS[8], reservation_ttl)
local admitted = capacity >= 0 and num_requests + 1 or 0
return answer(1, '', 0, admitted, tpm >= 0 and tokens_used + cost or 0)
"""
)


COMPLETE_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: tokens log, token costs, tokens sum, day, month, leases, reservation
-- ARGV: reserved tokens, used tokens, request id
local request_id = ARGV[3]
redis.call('ZREM', KEYS[6], request_id)
local record = redis.call('HMGET', KEYS[7], 'd', 'm', 'n')
if not record[3] then return 0 end
redis.call('DEL', KEYS[7])
local refund = math.min(tonumber(record[3]), tonumber(ARGV[1])) - tonumber(ARGV[2])
if refund <= 0 then return 0 end

-- only while the admission is still in the tokens window
local logged = tonumber(redis.call('HGET', KEYS[2], request_id))
if logged and redis.call('ZSCORE', KEYS[1], request_id) then
  local given = math.min(logged, refund)
  redis.call('HSET', KEYS[2], request_id, logged - given)
  local sum = tonumber(redis.call('GET', KEYS[3])) or 0
  redis.call('SET', KEYS[3], math.max(0, sum - given), 'KEEPTTL')
end
-- a day or month that has rolled over since admission keeps its fresh count
local function give_back(key, window)
  local used = window_used(key, window)
  if used > 0 then redis.call('HSET', key, 'n', math.max(0, used - refund)) end
end
give_back(KEYS[4], tonumber(record[1]))
give_back(KEYS[5], tonumber(record[2]))
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
redis.call('ZADD', KEYS[1], 'XX', score(now + lease_ttl), ARGV[3])
redis.call('PEXPIRE', KEYS[1], lease_ttl + WINDOW_MS)
return 1
"""
)


USAGE_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: requests log, tokens log, token costs, tokens sum, day, month, leases
-- ARGV: now ms ('' = server time), then the limits as ADMIT takes them (rpm, burst, tpm, ...)
local now = clock_ms(ARGV[1])
local rpm, burst, tpm = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local requests_left, requests_reset = -1, 0
if rpm >= 0 then
  local count = requests_in_window(KEYS[1], now)
  requests_left = math.max(0, rpm + burst - count)
  requests_reset = wait_for_request(KEYS[1], now, count, rpm + burst)
end
local tokens_used = tokens_in_window(KEYS[2], KEYS[3], KEYS[4], now)
local tokens_reset = 0
if tpm >= 0 then tokens_reset = wait_for_tokens(KEYS[2], KEYS[3], now, tokens_used, 1, tpm) end
return {
  requests_left,
  math.ceil(requests_reset),
  tokens_used,
  math.ceil(tokens_reset),
  window_used(KEYS[5], math.floor(now / DAY_MS)),
  window_used(KEYS[6], month_window(now)),
  redis.call('ZCOUNT', KEYS[7], '(' .. score(now), '+inf'),
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
