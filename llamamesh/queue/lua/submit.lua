-- KEYS: the tenant's work stream (affinity on: the job's partition of it), the request's submitted
-- marker, the pool's tenants hash, the pool's partitions key, and (affinity on) every partition of
-- the tenant's stream. ARGV: job field, encoded job, max waiting (0: no bound), group, the marker's
-- ttl, tenant, weight, the partitions P (0: off).
-- Returns -1 (queued), -2 (queued before: a retried write whose first try was applied; nothing
-- queued again, the marker's ttl set again: a write, so a WAIT after this one covers the first
-- try's), -3 (the pool is partitioned otherwise: nothing queued), or how many wait unleased (the
-- tenant's streams are full: nothing queued). A new stream gets the workers' group here (from its
-- start; affinity on: every partition's at once), so no job is queued where no worker reads.
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
  for i = 5, #KEYS do table.insert(streams, KEYS[i]) end
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
if #KEYS > 4 and redis.call('EXISTS', KEYS[1]) == 0 then
  for _, s in ipairs(streams) do pcall(redis.call, 'XGROUP', 'CREATE', s, ARGV[4], '0', 'MKSTREAM') end
end
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[4], '0', 'MKSTREAM')
redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[6], ARGV[7])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[5])
return -1
