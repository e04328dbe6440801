-- KEYS: the caller's attempts list, its called-off flag. ARGV: the flag's life for an id not in
-- use. A Cancel holds while the request's record lives (the same TTL); for an id with no record
-- yet it holds a short while ('a', ahead of its Generate), which begin_attempt.lua turns into the
-- request's own.
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('SET', KEYS[2], '1', 'PX', ttl)
else redis.call('SET', KEYS[2], 'a', 'EX', ARGV[1]) end
return 0
