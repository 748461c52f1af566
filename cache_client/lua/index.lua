-- kvroute shared prefix index: apply a batch of buffered writes, then (optionally) answer
-- one lookup or a usage query, atomically and in one round trip.
--
-- Layout (T is the deployment's key prefix including its hash tag, e.g. "{kvroute}"; every
-- key below shares that tag, so one call touches one Redis Cluster slot):
--   T:locs       set    location names
--   T:z:<loc>    zset   prefix key (8 raw bytes) -> last use, in microseconds of server time,
--                       strictly increasing per location: the LRU order and the TTL clock
--   T:c:<loc>    hash   prefix key -> tokens the capacity model charges for it
--   T:m:<loc>    hash   used (tokens held), clock (last score handed out), cap (capacity)
--   T:epoch      string random token set when the index is created; a new value tells the
--                       replicas that Redis lost its data and needs their local views
--
-- KEYS[1] = T:locs (routes the call; the script derives the other names from ARGV[1])
-- ARGV[1] T, ARGV[2] ttl in microseconds, ARGV[3] default capacity in tokens,
-- ARGV[4] epoch to install if none exists, ARGV[5] query: "" | "L" (lookup) | "U" (usage),
-- ARGV[6] n, the number of chains to look up, ARGV[7..6+n] the chains (8-byte keys
-- concatenated; concurrent lookups of one replica share a call), then the writes, each one of
--   "R" loc cap keys charges   record (cap "" = unknown; charges: 4-byte big-endian each)
--   "E" loc keys               evict
--   "D" loc                    drop the location
--   "C" loc cap                set the capacity
-- Returns {epoch, one string per chain} for "L" (per location holding the chain's first
-- key: 2-byte name length, name, 4-byte depth, all big-endian), {epoch, name1, tokens1, ...}
-- for "U", {epoch} otherwise.

local T = ARGV[1]
local ttl_us = tonumber(ARGV[2])
local ttl_ms = math.ceil(ttl_us / 1000)
local default_cap = tonumber(ARGV[3])
local locs_key = KEYS[1]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cutoff = now - ttl_us
-- Lua's own number-to-string conversion keeps 14 digits; scores need all 16.
local below_cutoff = string.format('(%.0f', cutoff)

local epoch = redis.call('GET', T .. ':epoch')
if not epoch then
  epoch = ARGV[4]
  redis.call('SET', T .. ':epoch', epoch)
end

local function names(loc)
  return T .. ':z:' .. loc, T .. ':c:' .. loc, T .. ':m:' .. loc
end

local function touch(z, c, m)
  redis.call('PEXPIRE', z, ttl_ms)
  redis.call('PEXPIRE', c, ttl_ms)
  redis.call('PEXPIRE', m, ttl_ms)
  redis.call('PEXPIRE', locs_key, ttl_ms)
end

-- Entries older than the TTL leave the capacity model too, in batches that stay well
-- under Lua's unpack limit.
local function purge(z, c, m)
  while true do
    local old = redis.call('ZRANGEBYSCORE', z, '-inf', below_cutoff, 'LIMIT', 0, 512)
    if #old == 0 then return end
    local charges = redis.call('HMGET', c, unpack(old))
    local freed = 0
    for i = 1, #charges do freed = freed + (tonumber(charges[i]) or 0) end
    redis.call('ZREM', z, unpack(old))
    redis.call('HDEL', c, unpack(old))
    redis.call('HINCRBY', m, 'used', -freed)
  end
end

local function record(loc, cap_arg, keys, charges)
  local z, c, m = names(loc)
  purge(z, c, m)
  local meta = redis.call('HMGET', m, 'used', 'clock', 'cap')
  local used = tonumber(meta[1]) or 0
  local clock = tonumber(meta[2]) or 0
  local cap = tonumber(meta[3])
  if not cap then
    cap = tonumber(cap_arg)
    if cap then
      redis.call('HSET', m, 'cap', cap)
    else
      cap = default_cap
    end
  end
  if clock < now then clock = now end
  -- Tail first, so that the chain's head ends up most recent (as MemoryIndex does).
  local n = #keys / 8
  for i = n, 1, -1 do
    clock = clock + 1
    local k = string.sub(keys, i * 8 - 7, i * 8)
    if redis.call('ZADD', z, clock, k) == 1 then
      local charge = struct.unpack('>I4', charges, i * 4 - 3)
      redis.call('HSET', c, k, charge)
      used = used + charge
    end
  end
  while used > cap do
    local popped = redis.call('ZPOPMIN', z)
    if #popped == 0 then break end
    used = used - (tonumber(redis.call('HGET', c, popped[1])) or 0)
    redis.call('HDEL', c, popped[1])
  end
  redis.call('HSET', m, 'used', used, 'clock', clock)
  redis.call('SADD', locs_key, loc)
  touch(z, c, m)
end

local function evict(loc, keys)
  local z, c, m = names(loc)
  if redis.call('EXISTS', m) == 0 then return end
  local freed = 0
  for i = 1, #keys / 8 do
    local k = string.sub(keys, i * 8 - 7, i * 8)
    if redis.call('ZREM', z, k) == 1 then
      freed = freed + (tonumber(redis.call('HGET', c, k)) or 0)
      redis.call('HDEL', c, k)
    end
  end
  if freed > 0 then redis.call('HINCRBY', m, 'used', -freed) end
end

local function drop(loc)
  local z, c, m = names(loc)
  redis.call('DEL', z, c, m)
  redis.call('SREM', locs_key, loc)
end

local function set_capacity(loc, cap)
  local z, c, m = names(loc)
  redis.call('HSET', m, 'cap', cap)
  redis.call('HSETNX', m, 'used', 0)
  redis.call('SADD', locs_key, loc)
  touch(z, c, m)
end

-- Per location, how many leading keys of `chain` it holds (locations holding none omitted).
-- Most locations' runs end within the first few keys (at the start, or right after a head
-- that every location shares: tools, system prompt), so each location is probed with a
-- ZMSCORE of 4 keys, then 8, 16, ... 64: about as many members as its run is long, in a
-- handful of calls. (Measured: the members looked up, not the calls, dominate the cost.)
local function lookup(locs, chain)
  local found = {}
  local n = #chain / 8
  if n == 0 then return '' end
  local keys = {}
  for k = 1, n do keys[k] = string.sub(chain, k * 8 - 7, k * 8) end
  for _, loc in ipairs(locs) do
    local z = T .. ':z:' .. loc
    local depth = 0
    local from = 1
    local size = 4
    while from <= n do
      local to = math.min(n, from + size - 1)
      if size < 64 then size = size * 2 end
      local scores = redis.call('ZMSCORE', z, unpack(keys, from, to))
      local held = 0
      for k = 1, to - from + 1 do
        local sc = scores[k]
        if sc and tonumber(sc) >= cutoff then held = held + 1 else break end
      end
      depth = depth + held
      if held < to - from + 1 then break end
      from = to + 1
    end
    if depth > 0 then
      found[#found + 1] = struct.pack('>I2', #loc) .. loc .. struct.pack('>I4', depth)
    end
  end
  -- One string per chain: the client parses one reply element instead of two per location.
  return table.concat(found)
end

local nchains = tonumber(ARGV[6])
local i = 7 + nchains
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'R' then
    record(ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4])
    i = i + 5
  elseif op == 'E' then
    evict(ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'D' then
    drop(ARGV[i + 1])
    i = i + 2
  elseif op == 'C' then
    set_capacity(ARGV[i + 1], tonumber(ARGV[i + 2]))
    i = i + 3
  else
    return redis.error_reply('kvroute index: unknown op ' .. tostring(op))
  end
end

local out = {epoch}
local query = ARGV[5]

if query == 'L' then
  local locs = redis.call('SMEMBERS', locs_key)
  for c = 1, nchains do
    out[#out + 1] = lookup(locs, ARGV[6 + c])
  end
elseif query == 'U' then
  for _, loc in ipairs(redis.call('SMEMBERS', locs_key)) do
    local z, c, m = names(loc)
    if redis.call('EXISTS', m) == 0 then
      -- Everything the location held expired: forget the name too.
      redis.call('DEL', z, c)
      redis.call('SREM', locs_key, loc)
    else
      purge(z, c, m)
      out[#out + 1] = loc
      out[#out + 1] = tonumber(redis.call('HGET', m, 'used')) or 0
    end
  end
end

return out
