-- KEYS: the file's hash, the owner's files (sorted set), the owner's stored bytes (a counter).
-- ARGV: file id. Deletes the file and takes its size off the owner's bytes: 1 deleted, 0 none.
local size = tonumber(redis.call('HGET', KEYS[1], 'size') or '-1')
if size < 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local left = redis.call('DECRBY', KEYS[3], size)
if left <= 0 then redis.call('DEL', KEYS[3]) end
return 1
