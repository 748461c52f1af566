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
-- ARGV[6] (optional) the prompt ends this replica sent since its last sync (JSON, opaque
-- here), or "": appended to the stream T:ends (capped, expiring an hour after the last
-- append); ARGV[7] the last stream id this replica has read ("0-0" at first).
-- Returns {the other live replicas' counts, their cost statistics (only if ARGV[5] is set),
-- the ends the other replicas appended after ARGV[7] (at most 256 entries), the last id read,
-- the ids of every live replica, this one included}.

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
  return {{}, {}, {}, '', {}}
end
local costs = ARGV[5] or ''
if costs ~= '' then
  redis.call('SET', T .. ':lbc:' .. me, costs, 'PX', lease * 30)
end
redis.call('ZADD', KEYS[1], now + lease, me)
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('SET', T .. ':lb:' .. me, ARGV[4], 'PX', lease)

local out, stats = {}, {}
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, id in ipairs(live) do
  if id ~= me then
    local counts = redis.call('GET', T .. ':lb:' .. id)
    if counts then out[#out + 1] = counts end
    if costs ~= '' then
      local c = redis.call('GET', T .. ':lbc:' .. id)
      if c then stats[#stats + 1] = c end
    end
  end
end
local ends, seen = {}, ARGV[7] or ''
if seen ~= '' then
  local stream = T .. ':ends'
  if (ARGV[6] or '') ~= '' then
    redis.call('XADD', stream, 'MAXLEN', '~', 4096, '*', 'r', me, 'd', ARGV[6])
    redis.call('PEXPIRE', stream, 3600000)
  end
  -- The entry after `seen`: its sequence number + 1 (XRANGE's exclusive "(" needs Redis 6.2).
  local ms, seq = string.match(seen, '^(%d+)-(%d+)$')
  local from = ms .. '-' .. (tonumber(seq) + 1)
  for _, entry in ipairs(redis.call('XRANGE', stream, from, '+', 'COUNT', 256)) do
    seen = entry[1]
    local fields = entry[2]
    if fields[2] ~= me then ends[#ends + 1] = fields[4] end
  end
end
return {out, stats, ends, seen, live}
