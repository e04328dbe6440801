-- KEYS: the file's hash, the owner's files (sorted set), the owner's stored bytes (a counter).
-- ARGV: file id, created_at, size, the owner's most bytes (0: no bound), then the hash's field/value
-- pairs. Stores the file unless the owner's files would then hold more than the most: 1 stored,
-- else the bytes they hold already.
local size, most = tonumber(ARGV[3]), tonumber(ARGV[4])
local held = tonumber(redis.call('GET', KEYS[3]) or '0')
if most > 0 and held + size > most then return {0, held} end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('INCRBY', KEYS[3], size)
return {1, held + size}
