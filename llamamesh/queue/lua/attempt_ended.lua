-- KEYS: the caller's attempts list. ARGV: the id of an attempt that just ended, ttl. When it is
-- the latest attempt, the record now lives as long as the events do (Attach to it: NOT_FOUND
-- after).
local last = redis.call('LINDEX', KEYS[1], -1)
if last and string.find(last, '"attempt_id": "' .. ARGV[1] .. '"', 1, true) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 0
