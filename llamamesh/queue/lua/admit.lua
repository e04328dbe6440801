-- KEYS: rate hash. ARGV: requests/s, burst, tokens/min, the hash's ttl (ms), tokens reserved by the
-- request (its max_tokens times its samples). Returns 0 (admitted) or {wait ms, which}. Nothing
-- changes when refused.
--! include redis_now
local rps, burst, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local r, t
if rps > 0 then
  r = math.min(burst, (tonumber(h[1]) or burst) + (now - (tonumber(h[2]) or now)) * rps / 1000)
  if r < 1 then return {math.ceil((1 - r) * 1000 / rps), 'requests_per_s'} end
end
if tpm > 0 then
  t = math.min(tpm, (tonumber(h[3]) or tpm) + (now - (tonumber(h[4]) or now)) * tpm / 60000)
  if t <= 0 then return {math.ceil((1 - t) * 60000 / tpm), 'tokens_per_min'} end
end
if rps > 0 then redis.call('HSET', KEYS[1], 'r', tostring(r - 1), 'rt', now) end
if tpm > 0 then redis.call('HSET', KEYS[1], 't', tostring(t - (tonumber(ARGV[5]) or 0)), 'tt', now) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
return 0
