-- KEYS: rate hash. ARGV: tokens/min, tokens generated less those reserved at admission (below zero:
-- given back, up to a full bucket), the hash's ttl (ms).
--! include redis_now
local tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local h = redis.call('HMGET', KEYS[1], 't', 'tt')
local t = math.min(tpm, (tonumber(h[1]) or tpm) + (now - (tonumber(h[2]) or now)) * tpm / 60000)
redis.call('HSET', KEYS[1], 't', tostring(math.min(tpm, t - n)), 'tt', now)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 0
