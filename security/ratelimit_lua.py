"""The two Lua scripts behind RedisStore; security/ratelimit_store.py's InProcessStore mirrors them line for line.

Times are microseconds since EPOCH on Redis `TIME` (keeps doubles exact to ~0.02 µs). Per bucket i the keys are
KEYS[3i-2] requests TAT, KEYS[3i-1] tokens TAT, KEYS[3i] concurrency lease zset (member = lease id, score = expiry).
GCRA (rwz/redis-gcra) with a one-minute burst: allowed iff tat + cost*T - now <= 60 s, then tat += cost*T.
"""

from __future__ import annotations

_PRELUDE = """
local EPOCH, WINDOW, EPS = 1700000000, 60000000, 1
local t = redis.call('TIME')
local now = (tonumber(t[1]) - EPOCH) * 1000000 + tonumber(t[2])
local function store_tat(key, tat)
  if tat > now then
    redis.call('SET', key, string.format('%.3f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
  else
    redis.call('DEL', key)
  end
end
"""

# ARGV: cost, lease id, lease ttl µs, then per bucket: request interval µs, token interval µs, max concurrent
# (0 = unlimited). Returns {allowed, failed bitmask, then per bucket: requests reset ns, tokens reset ns}.
ADMIT_LUA = (
    _PRELUDE
    + """
local cost, lease, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local n = #KEYS / 3
local failed, tats = 0, {}
for i = 1, n do
  for d = 1, 2 do
    local T, inc, tat = tonumber(ARGV[3 * i + d]), (d == 1) and 1 or cost, now
    if T > 0 then
      tat = math.max(tonumber(redis.call('GET', KEYS[3 * i - 3 + d])) or now, now)
      if tat + inc * T - WINDOW - now > EPS then failed = failed + 2 ^ (3 * i - 4 + d) end
    end
    tats[2 * i - 2 + d] = tat
  end
  if tonumber(ARGV[3 * i + 3]) > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3 * i], '-inf', now)
    if redis.call('ZCARD', KEYS[3 * i]) >= tonumber(ARGV[3 * i + 3]) then failed = failed + 2 ^ (3 * i - 1) end
  end
end
if failed == 0 then
  for i = 1, n do
    for d = 1, 2 do
      local T, inc = tonumber(ARGV[3 * i + d]), (d == 1) and 1 or cost
      if T > 0 and inc > 0 then
        tats[2 * i - 2 + d] = tats[2 * i - 2 + d] + inc * T
        store_tat(KEYS[3 * i - 3 + d], tats[2 * i - 2 + d])
      end
    end
    if tonumber(ARGV[3 * i + 3]) > 0 then
      redis.call('ZADD', KEYS[3 * i], now + ttl, lease)
      redis.call('PEXPIRE', KEYS[3 * i], math.ceil(ttl / 1000) + 1)
    end
  end
end
local out = {failed == 0 and 1 or 0, failed}
for i = 1, n do
  out[#out + 1] = math.floor((tats[2 * i - 1] - now) * 1000 + 0.5)
  out[#out + 1] = math.floor((tats[2 * i] - now) * 1000 + 0.5)
end
return out
"""
)

# ARGV: token delta, lease id, release (1) or renew (0), lease ttl µs, then per bucket: token interval µs, has lease.
SETTLE_LUA = (
    _PRELUDE
    + """
local delta, lease, release, ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3] == '1', tonumber(ARGV[4])
for i = 1, #KEYS / 3 do
  local T = tonumber(ARGV[3 + 2 * i])
  if T > 0 and delta ~= 0 then
    store_tat(KEYS[3 * i - 1], math.max(tonumber(redis.call('GET', KEYS[3 * i - 1])) or now, now) + delta * T)
  end
  if ARGV[4 + 2 * i] == '1' then
    if release then
      redis.call('ZREM', KEYS[3 * i], lease)
    else
      redis.call('ZADD', KEYS[3 * i], now + ttl, lease)
      redis.call('PEXPIRE', KEYS[3 * i], math.ceil(ttl / 1000) + 1)
    end
  end
end
return 1
"""
)
