-- KEYS: the request's attempts list, its caller's called-off flag. ARGV: the encoded attempt,
-- first ('1': only if none yet), ttl. A record equal to the last one is a retried write whose
-- first try was applied: done already. A Cancel that came ahead of the request ('a') becomes the
-- request's own ('1', as long as its record).
if redis.call('LINDEX', KEYS[1], -1) == ARGV[1] then return 1 end
local fresh = redis.call('EXISTS', KEYS[1]) == 0
if ARGV[2] == '1' and not fresh then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if fresh then
  local off = redis.call('GET', KEYS[2])
  if off == 'a' then redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  elseif off then redis.call('DEL', KEYS[2]) end
end
return 1
