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

Each script may run twice for one call (the connection resends a command whose reply timed out)
and must mean the same then: an admission finds its own reservation, a completion finds none.
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
-- Every limit set (the tenant's, then its key's, then the tenant's for the model) is checked;
-- only when all admit is anything reserved, in all of them (all or nothing).
-- KEYS: reservation, then per set: requests log, tokens log, token costs, tokens sum, day,
--       month, leases
-- ARGV: now ms ('' = server time), cost, request id, lease ttl ms, reservation ttl ms,
--       concurrency retry ms, number of sets, then per set its limits in the order of
--       limits.SCRIPT_LIMIT_FIELDS (rpm, burst, tpm, max concurrency, daily, monthly; -1 = none)
-- Reply: allowed, reason, wait ms, refusing set (1-based, 0: none), then per set
--        requests left, requests reset ms, tokens left, tokens reset ms
local now = clock_ms(ARGV[1])
local cost, request_id = tonumber(ARGV[2]), ARGV[3]
local lease_ttl, reservation_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local concurrency_retry, num_sets = tonumber(ARGV[6]), tonumber(ARGV[7])

local day = math.floor(now / DAY_MS)
local month, month_reset = month_window(now)
local day_reset = (day + 1) * DAY_MS - now

local function fits(limit, used)
  return limit < 0 or used + cost <= limit
end

local function read_set(i)
  local k, a = 1 + (i - 1) * 7, 7 + (i - 1) * 6
  local set = {requests = KEYS[k + 1], log = KEYS[k + 2], costs = KEYS[k + 3],
    sum = KEYS[k + 4], day = KEYS[k + 5], month = KEYS[k + 6], leases = KEYS[k + 7],
    rpm = tonumber(ARGV[a + 1]), burst = tonumber(ARGV[a + 2]), tpm = tonumber(ARGV[a + 3]),
    max_concurrency = tonumber(ARGV[a + 4]), daily = tonumber(ARGV[a + 5]),
    monthly = tonumber(ARGV[a + 6])}
  set.capacity = set.rpm < 0 and -1 or set.rpm + set.burst
  set.num_requests = set.rpm < 0 and 0 or requests_in_window(set.requests, now)
  set.tokens_used = set.tpm < 0 and 0 or tokens_in_window(set.log, set.costs, set.sum, now)
  set.day_used = window_used(set.day, day)
  set.month_used = window_used(set.month, month)
  redis.call('ZREMRANGEBYSCORE', set.leases, '-inf', now)
  set.num_leases = redis.call('ZCARD', set.leases)
  return set
end

local function refuse(reason, wait) return reason, wait end

-- nil when the set admits the request, else the reason and the wait
local function refusal(set)
  if not fits(set.monthly, set.month_used) then return refuse('monthly_quota', month_reset) end
  if not fits(set.daily, set.day_used) then return refuse('daily_quota', day_reset) end
  if set.capacity >= 0 and set.num_requests >= set.capacity then
    return refuse('rate_limit_requests',
      wait_for_request(set.requests, now, set.num_requests, set.capacity))
  end
  if not fits(set.tpm, set.tokens_used) then
    return refuse('rate_limit_tokens',
      wait_for_tokens(set.log, set.costs, now, set.tokens_used, cost, set.tpm))
  end
  if set.max_concurrency >= 0 and set.num_leases >= set.max_concurrency then
    return refuse('concurrency', concurrency_retry)
  end
  return nil
end

local function reserve(set)
  if set.capacity >= 0 then
    redis.call('ZADD', set.requests, score(now), request_id)
    redis.call('PEXPIRE', set.requests, 2 * WINDOW_MS)
  end
  if set.tpm >= 0 then
    log_tokens(set.log, set.costs, set.sum, now, request_id, cost, set.tokens_used)
  end
  redis.call('HSET', set.day, 'w', day, 'n', set.day_used + cost)
  redis.call('PEXPIRE', set.day, math.ceil(day_reset) + DAY_MS)
  redis.call('HSET', set.month, 'w', month, 'n', set.month_used + cost)
  redis.call('PEXPIRE', set.month, math.ceil(month_reset) + DAY_MS)
  redis.call('ZADD', set.leases, score(now + lease_ttl), request_id)
  redis.call('PEXPIRE', set.leases, lease_ttl + WINDOW_MS)
end

-- what is left of each set's rate limits, counting this request when it was admitted
-- (`added`: 0 when the windows already count it)
local function reply(allowed, reason, wait, refused_by, sets, added)
  added = added or allowed
  local out = {allowed, reason, math.ceil(wait), refused_by}
  for _, set in ipairs(sets) do
    local count = set.num_requests + added
    local used = set.tokens_used + added * cost
    local requests_left, requests_reset, tokens_left, tokens_reset = -1, 0, -1, 0
    if set.capacity >= 0 then
      requests_left = math.max(0, set.capacity - count)
      requests_reset = wait_for_request(set.requests, now, count, set.capacity)
    end
    if set.tpm >= 0 then
      tokens_left = math.max(0, set.tpm - used)
      tokens_reset = wait_for_tokens(set.log, set.costs, now, used, 1, set.tpm)
    end
    for _, value in ipairs({requests_left, requests_reset, tokens_left, tokens_reset}) do
      out[#out + 1] = math.ceil(value)
    end
  end
  return out
end

-- A resent call (redis-py resends a command whose reply timed out) finds its own reservation:
-- it is admitted again and charged nothing more, so it can neither refuse itself nor pay twice.
local resent = redis.call('EXISTS', KEYS[1]) == 1
local sets = {}
for i = 1, num_sets do sets[i] = read_set(i) end
if resent then return reply(1, '', 0, 0, sets, 0) end
for i, set in ipairs(sets) do
  local reason, wait = refusal(set)
  if reason then return reply(0, reason, wait, i, sets) end
end
for _, set in ipairs(sets) do reserve(set) end
redis.call('HSET', KEYS[1], 'd', day, 'm', month, 'n', cost)
redis.call('PEXPIRE', KEYS[1], reservation_ttl)
return reply(1, '', 0, 0, sets)
"""
)


COMPLETE_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: reservation, then per limit set: tokens log, token costs, tokens sum, day, month, leases
-- ARGV: reserved tokens, used tokens, request id
local request_id = ARGV[3]
local num_sets = (#KEYS - 1) / 6
for i = 1, num_sets do redis.call('ZREM', KEYS[1 + i * 6], request_id) end
local record = redis.call('HMGET', KEYS[1], 'd', 'm', 'n')
if not record[3] then return 0 end
redis.call('DEL', KEYS[1])
local refund = math.min(tonumber(record[3]), tonumber(ARGV[1])) - tonumber(ARGV[2])
if refund <= 0 then return 0 end

-- only while the admission is still in the tokens window
local function refund_tokens(log, costs, sum_key)
  local logged = tonumber(redis.call('HGET', costs, request_id))
  if logged and redis.call('ZSCORE', log, request_id) then
    local given = math.min(logged, refund)
    redis.call('HSET', costs, request_id, logged - given)
    local sum = tonumber(redis.call('GET', sum_key)) or 0
    redis.call('SET', sum_key, math.max(0, sum - given), 'KEEPTTL')
  end
end
-- a day or month that has rolled over since admission keeps its fresh count
local function give_back(key, window)
  local used = window_used(key, window)
  if used > 0 then redis.call('HSET', key, 'n', math.max(0, used - refund)) end
end
for i = 1, num_sets do
  local k = 1 + (i - 1) * 6
  refund_tokens(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3])
  give_back(KEYS[k + 4], tonumber(record[1]))
  give_back(KEYS[k + 5], tonumber(record[2]))
end
return refund
"""
)


RENEW_LUA = (
    LUA_PRELUDE
    + """
-- KEYS: the leases of each limit set; ARGV: now ms ('' = server time), lease ttl ms, request id
-- Reply: 1 when every lease was still held (and is renewed), else 0
local now = clock_ms(ARGV[1])
local lease_ttl = tonumber(ARGV[2])
local all_held = 1
for _, leases in ipairs(KEYS) do
  local expiry = tonumber(redis.call('ZSCORE', leases, ARGV[3]))
  if expiry and expiry > now then
    redis.call('ZADD', leases, 'XX', score(now + lease_ttl), ARGV[3])
    redis.call('PEXPIRE', leases, lease_ttl + WINDOW_MS)
  else
    if expiry then redis.call('ZREM', leases, ARGV[3]) end
    all_held = 0
  end
end
return all_held
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
