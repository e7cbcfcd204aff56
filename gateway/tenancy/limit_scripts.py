"""The Lua scripts behind `RateLimiter`: each check, reservation, refund and lease renewal is one
atomic script, run by its SHA (loaded once, reloaded after a Redis restart).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

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
