-- KEYS: streams zset. ARGV: stream id, most, lease ms. Returns 0 (opened) or how many are open.
--! include redis_now
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return n end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 0
