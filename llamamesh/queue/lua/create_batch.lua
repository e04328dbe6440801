-- KEYS: meta. ARGV: now, then the record as field value ... Returns 1 (created), or the stored
-- {fingerprint, enqueued, created_at, expires_at} of an existing batch (touched when unsealed: a
-- submission works on it).
if redis.call('EXISTS', KEYS[1]) == 1 then
  local f = redis.call('HMGET', KEYS[1], 'fingerprint', 'enqueued', 'created_at', 'expires_at')
  if not f[2] then redis.call('HSET', KEYS[1], 'touched', ARGV[1]) end
  return f
end
redis.call('HSET', KEYS[1], 'touched', ARGV[1], unpack(ARGV, 2))
return 1
