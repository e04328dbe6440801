-- KEYS: the pool's tenants hash, a tenant's work stream (affinity on: each of its partitions).
-- ARGV: the tenant, group. Makes the streams and groups of a tenant still listed (the default
-- tenant always) when a read found them missing; returns 1 if it made any. One script, like
-- forget_tenant.lua: a forgotten tenant's stream stays gone.
if ARGV[1] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
local made = 0
for i = 2, #KEYS do
  if pcall(redis.call, 'XGROUP', 'CREATE', KEYS[i], ARGV[2], '0', 'MKSTREAM') then made = 1 end
end
return made
