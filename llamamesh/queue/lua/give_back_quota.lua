-- KEYS: quota hash, held hash. ARGV: batch id, what ('items': the batch ended; 'all': its
-- record is gone). Safe to repeat: what was given back is no longer held.
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return 0 end
local n, b, at = string.match(held, '(%d+) (%d+) (%d+)')
n, b = tonumber(n), tonumber(b)
if n > 0 then redis.call('HINCRBY', KEYS[1], 'items', -n) end
if ARGV[2] == 'all' then
  redis.call('HINCRBY', KEYS[1], 'bytes', -b)
  redis.call('HDEL', KEYS[2], ARGV[1])
elseif n > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], '0 ' .. b .. ' ' .. at)
end
return 1
