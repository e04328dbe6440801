-- Ends the items no worker has started, without running them. KEYS: meta, done, results, ids,
-- started, link. ARGV: now, retention (s), status ('expired': only past the deadline, and from then on
-- no item starts; 'cancelled': a cancelling or failed batch), then custom_id, encoded result, ...
-- Returns how many it ended, -1 (no such batch), -2 (nothing to do in this state).
--! include batch_finish
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_at')
if not f[1] then return -1 end
if ARGV[3] == 'expired' then
  if f[1] ~= 'in_progress' or tonumber(ARGV[1]) <= tonumber(f[2]) then return -2 end
  redis.call('HSET', KEYS[1], 'closing', 'expired')
elseif f[1] ~= 'cancelling' and f[1] ~= 'failed' then return -2 end
local n = 0
for i = 4, #ARGV, 2 do
  if redis.call('SISMEMBER', KEYS[5], ARGV[i]) == 0 and redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[3]) == 1 then
    redis.call('XADD', KEYS[3], '*', 'r', ARGV[i + 1])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[1], ARGV[3], n) end
finish(ARGV[1], ARGV[2])
return n
