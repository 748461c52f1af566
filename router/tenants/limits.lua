-- kvroute per-tenant limits, shared by every router replica: admit, debit and release,
-- atomically, in one call (the arithmetic of router/tenants/limits.py, LocalLimits).
--
-- Keys (T is the deployment's prefix with its hash tag, e.g. "{kvroute}": one Redis Cluster
-- slot with the index, so this call can ride in the index lookup's pipeline):
--   T:tl:<tenant>  hash  r (request bucket level), rt (its time, ms), rs/rr (its size/rate)
--                        t (token bucket level), tt (its time, ms), ts/tr (size/rate)
--   T:tc:<tenant>  zset  request id -> lease deadline (ms): the requests in flight
-- KEYS[1] = T:tl (routes the call); ARGV[1] T, ARGV[2] concurrency lease in ms, then ops:
--   "A" tenant id rps tpm conc prompt   admit (rps/tpm/conc "" = no such limit)
--   "D" tenant tokens                   debit tokens learnt after admission
--   "R" tenant id                       release a request in flight
-- Returns one reply per "A", in order: {0, 0} admitted, or {code, retry_after_ms} with
-- code 1 requests_per_s, 2 tokens_per_min, 3 concurrent. Nothing is charged on a refusal.

local T = ARGV[1]
local lease = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local idle_ms = 120000  -- a bucket untouched this long is full again anyway: let it expire

-- The bucket `name` of hash `key` at `now`: its level, refilled (a new bucket or new
-- limits start full).
local function level(key, name, size, rate)
  local v = redis.call('HMGET', key, name, name .. 't', name .. 's', name .. 'r')
  local lvl, at, s, r = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])
  if lvl == nil or s ~= size or r ~= rate then
    return size
  end
  if now > at then
    lvl = math.min(size, lvl + (now - at) * rate / 1000)
  end
  return lvl
end

local function store(key, name, lvl, size, rate)
  redis.call('HSET', key, name, tostring(lvl), name .. 't', now, name .. 's', tostring(size), name .. 'r', tostring(rate))
  redis.call('PEXPIRE', key, idle_ms)
end

local out = {}
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'A' then
    local tenant, id = ARGV[i + 1], ARGV[i + 2]
    local rps, tpm, conc = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
    local prompt = tonumber(ARGV[i + 6])
    i = i + 7
    local bkey, ckey = T .. ':tl:' .. tenant, T .. ':tc:' .. tenant
    local verdict = nil
    local rsize, rlvl, tlvl, need
    if rps then
      rsize = math.max(rps, 1)
      rlvl = level(bkey, 'r', rsize, rps)
      if rlvl < 1 then verdict = {1, math.ceil((1 - rlvl) * 1000 / rps)} end
    end
    if not verdict and tpm then
      need = math.min(math.max(prompt, 0), tpm)
      tlvl = level(bkey, 't', tpm, tpm / 60)
      if tlvl < need then verdict = {2, math.ceil((need - tlvl) * 60000 / tpm)} end
    end
    if not verdict and conc then
      redis.call('ZREMRANGEBYSCORE', ckey, '-inf', now)  -- leases of replicas that died
      if redis.call('ZCARD', ckey) >= conc then verdict = {3, 1000} end
    end
    if verdict then
      out[#out + 1] = verdict
    else
      if rps then store(bkey, 'r', rlvl - 1, rsize, rps) end
      if tpm then store(bkey, 't', tlvl - math.max(prompt, 0), tpm, tpm / 60) end
      if conc then
        redis.call('ZADD', ckey, now + lease, id)
        redis.call('PEXPIRE', ckey, lease)
      end
      out[#out + 1] = {0, 0}
    end
  elseif op == 'D' then
    local tenant, tokens = ARGV[i + 1], tonumber(ARGV[i + 2])
    i = i + 3
    local bkey = T .. ':tl:' .. tenant
    local v = redis.call('HMGET', bkey, 't', 'ts', 'tr')
    local size, rate = tonumber(v[2]), tonumber(v[3])
    if size and rate then
      -- Refilled to now first, then into debt down to one bucket's worth at most.
      local lvl = level(bkey, 't', size, rate)
      store(bkey, 't', math.max(lvl - tokens, -size), size, rate)
    end
  elseif op == 'R' then
    redis.call('ZREM', T .. ':tc:' .. ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  else
    return redis.error_reply('limits.lua: unknown op ' .. tostring(op))
  end
end
return out
