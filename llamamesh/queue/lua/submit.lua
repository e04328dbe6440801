-- KEYS: the tenant's work stream (affinity on: the partition its prefix key hashes to), the
-- request's submitted marker, the pool's tenants hash, the pool's partitions key, and (affinity on)
-- the pool's owners hash, its placements (a hash: key -> partition), their last uses (a sorted
-- set: key -> ms), the keys placed in each partition (a hash), then every partition of the
-- tenant's stream. ARGV: job field, encoded job, max waiting (0: no bound), group, the marker's
-- ttl, tenant, weight, the partitions P (0: off), placement ("balanced" or "hash"), the placements'
-- ttl (ms), the job's key in the placements ("": none), the partition it hashes to, how many
-- unused keys to forget at most, the most keys placed.
-- Returns -1 (queued), -2 (queued before: a retried write whose first try was applied; nothing
-- queued again, the marker's ttl set again: a write, so a WAIT after this one covers the first
-- try's), -3 (the pool is partitioned otherwise: nothing queued), or how many wait unleased (the
-- tenant's streams are full: nothing queued). A new stream gets the workers' group here (from its
-- start; affinity on: every partition's at once), so no job is queued where no worker reads.
-- Balanced placement (affinity.Placements is its twin): a key keeps the partition it was first
-- put in while it is used within the ttl; a new one goes where affinity.least_loaded says.
local stored = redis.call('GET', KEYS[4])
if ARGV[8] ~= '0' and not stored then redis.call('SET', KEYS[4], ARGV[8]); stored = ARGV[8] end
if (stored or '0') ~= ARGV[8] then return -3 end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('EXPIRE', KEYS[2], ARGV[5])
  return -2
end
local streams = {KEYS[1]}
if #KEYS > 4 then
  streams = {}
  for i = 9, #KEYS do table.insert(streams, KEYS[i]) end
end
local most = tonumber(ARGV[3])
if most > 0 then
  local n = 0
  for _, s in ipairs(streams) do n = n + redis.call('XLEN', s) end
  if n >= most then
    local leased = 0
    for _, s in ipairs(streams) do
      local ok, summary = pcall(redis.call, 'XPENDING', s, ARGV[4])
      if ok then leased = leased + tonumber(summary[1]) end
    end
    if n - leased >= most then return n - leased end
  end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function forget(key)
  local k = redis.call('HGET', KEYS[6], key)
  if k then
    redis.call('HINCRBY', KEYS[8], k, -1)
    redis.call('HDEL', KEYS[6], key)
  end
  redis.call('ZREM', KEYS[7], key)
end

local function least_loaded(P, hashed, now)
  local load, whose, per = {}, {}, {}
  local raw = redis.call('HGETALL', KEYS[8])
  for i = 1, #raw, 2 do load[tonumber(raw[i])] = tonumber(raw[i + 1]) end
  raw = redis.call('HGETALL', KEYS[5])
  for i = 1, #raw, 2 do
    local k, sp = tonumber(raw[i]), string.find(raw[i + 1], ' ', 1, true)
    if k and sp and tonumber(string.sub(raw[i + 1], sp + 1)) > now then
      whose[k] = string.sub(raw[i + 1], 1, sp - 1)
    end
  end
  for k = 0, P - 1 do
    whose[k] = whose[k] or ''
    per[whose[k]] = (per[whose[k]] or 0) + (load[k] or 0)
  end
  local best = hashed
  local a, b = per[whose[hashed]], load[hashed] or 0
  for i = 1, P - 1 do
    local k = (hashed + i) % P
    local x, y = per[whose[k]], load[k] or 0
    if x < a or (x == a and y < b) then best, a, b = k, x, y end
  end
  return best
end

local target = KEYS[1]
if #KEYS > 4 and ARGV[9] == 'balanced' and ARGV[11] ~= '' then
  local P, key, now = tonumber(ARGV[8]), ARGV[11], now_ms()
  local old = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now - tonumber(ARGV[10]), 'LIMIT', 0, tonumber(ARGV[13]))
  for _, f in ipairs(old) do forget(f) end
  local k = tonumber(redis.call('HGET', KEYS[6], key) or '')
  if not k or k >= P then
    if k then forget(key) end
    k = least_loaded(P, tonumber(ARGV[12]), now)
    if redis.call('ZCARD', KEYS[7]) >= tonumber(ARGV[14]) then
      forget(redis.call('ZRANGE', KEYS[7], 0, 0)[1])
    end
    redis.call('HSET', KEYS[6], key, k)
    redis.call('HINCRBY', KEYS[8], k, 1)
  end
  redis.call('ZADD', KEYS[7], now, key)
  target = streams[k + 1]
end
if #KEYS > 4 and redis.call('EXISTS', target) == 0 then
  for _, s in ipairs(streams) do pcall(redis.call, 'XGROUP', 'CREATE', s, ARGV[4], '0', 'MKSTREAM') end
end
pcall(redis.call, 'XGROUP', 'CREATE', target, ARGV[4], '0', 'MKSTREAM')
redis.call('XADD', target, '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[6], ARGV[7])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[5])
return -1
