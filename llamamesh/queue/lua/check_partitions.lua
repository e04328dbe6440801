-- KEYS: the partitions key. ARGV: P. Records P if none is; returns the recorded P (a P of 0
-- records nothing: returns the recorded one, or 0).
local stored = redis.call('GET', KEYS[1])
if not stored then
  if ARGV[1] == '0' then return 0 end
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return tonumber(stored) or -1
