-- KEYS: meta, queued. Returns 1 (sealed now or before), 0 (items missing), -1 (no such batch).
local f = redis.call('HMGET', KEYS[1], 'total', 'enqueued')
if not f[1] then return -1 end
if f[2] then return 1 end
if redis.call('SCARD', KEYS[2]) < tonumber(f[1]) then return 0 end
redis.call('HSET', KEYS[1], 'enqueued', 1)
redis.call('DEL', KEYS[2])
return 1
