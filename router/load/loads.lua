-- kvroute shared load board: publish this replica's counts under a lease, read the others'.
--
-- Each replica owns one value, T:lb:<replica> (its per-worker counts, JSON), written whole
-- on every sync and expiring with its lease: a replica that crashes stops counting once its
-- lease runs out. T:lb is the registry, replica -> lease deadline (ms of server time).
--
-- KEYS[1] = T:lb; ARGV[1] T, ARGV[2] replica id, ARGV[3] lease in ms,
-- ARGV[4] counts (JSON), or "" when the replica leaves.
-- Returns the other live replicas' counts.

local T = ARGV[1]
local me = ARGV[2]
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[4] == '' then
  redis.call('ZREM', KEYS[1], me)
  redis.call('DEL', T .. ':lb:' .. me)
  return {}
end
redis.call('ZADD', KEYS[1], now + lease, me)
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('SET', T .. ':lb:' .. me, ARGV[4], 'PX', lease)

local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if id ~= me then
    local counts = redis.call('GET', T .. ':lb:' .. id)
    if counts then out[#out + 1] = counts end
  end
end
return out
