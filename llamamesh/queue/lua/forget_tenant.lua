-- KEYS: the pool's tenants hash, a tenant's work stream (affinity on: each of its partitions).
-- ARGV: the tenant, group. Forgets a tenant whose streams hold nothing (no entry, none leased);
-- returns 1 if it did. One script, like submit.lua: a submission lands either before the look
-- (kept) or after the delete (made again).
for i = 2, #KEYS do
  if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
  local ok, summary = pcall(redis.call, 'XPENDING', KEYS[i], ARGV[2])
  if ok and tonumber(summary[1]) > 0 then return 0 end
end
redis.call('HDEL', KEYS[1], ARGV[1])
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
