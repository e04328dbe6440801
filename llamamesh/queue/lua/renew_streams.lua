-- KEYS: streams zset. ARGV: lease ms, stream ids... (only those still there are renewed).
--! include redis_now
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
