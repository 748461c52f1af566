-- kvroute shared load board: publish this replica's counts under a lease, read the others'.
--
-- Each replica owns one value, T:lb:<replica> (its per-worker counts, JSON), written whole
-- on every sync and expiring with its lease: a replica that crashes stops counting once its
-- lease runs out. T:lb is the registry, replica -> lease deadline (ms of server time).
--
-- KEYS[1] = T:lb; ARGV[1] T, ARGV[2] replica id, ARGV[3] lease in ms,
-- ARGV[4] counts (JSON), or "" when the replica leaves;
-- ARGV[5] (optional) this replica's cost-model statistics per worker (JSON), or "": kept
-- under T:lbc:<replica> for 30 leases (they change slowly and are sent every second or so).
-- Returns {the other live replicas' counts, their cost statistics (only if ARGV[5] is set)}.

local T = ARGV[1]
local me = ARGV[2]
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[4] == '' then
  redis.call('ZREM', KEYS[1], me)
  redis.call('DEL', T .. ':lb:' .. me)
  redis.call('DEL', T .. ':lbc:' .. me)
  return {{}, {}}
end
local costs = ARGV[5] or ''
if costs ~= '' then
  redis.call('SET', T .. ':lbc:' .. me, costs, 'PX', lease * 30)
end
redis.call('ZADD', KEYS[1], now + lease, me)
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('SET', T .. ':lb:' .. me, ARGV[4], 'PX', lease)

local out, stats = {}, {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if id ~= me then
    local counts = redis.call('GET', T .. ':lb:' .. id)
    if counts then out[#out + 1] = counts end
    if costs ~= '' then
      local c = redis.call('GET', T .. ':lbc:' .. id)
      if c then stats[#stats + 1] = c end
    end
  end
end
return {out, stats}
