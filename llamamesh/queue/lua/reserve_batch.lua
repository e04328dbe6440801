-- KEYS: quota hash, held hash. ARGV: batch id, items, bytes, most items, most bytes, the batch's
-- fingerprint. A hold is "items bytes reserved-at-ms fingerprint". Returns -1 (held already: a
-- resubmission), -2 (held by a submission of other items under this id, which came first), 0
-- (reserved), {1, items held} or {2, bytes held} (over).
--! include redis_now
local hold = redis.call('HGET', KEYS[2], ARGV[1])
if hold then
  local fingerprint = string.match(hold, '^%d+ %d+ %d+ (%S+)')
  if fingerprint and fingerprint ~= ARGV[6] then return -2 end
  return -1
end
local items = tonumber(redis.call('HGET', KEYS[1], 'items') or '0')
local bytes = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
local n, b, most_n, most_b = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if most_n > 0 and items + n > most_n then return {1, items} end
if most_b > 0 and bytes + b > most_b then return {2, bytes} end
redis.call('HINCRBY', KEYS[1], 'items', n)
redis.call('HINCRBY', KEYS[1], 'bytes', b)
redis.call('HSET', KEYS[2], ARGV[1], n .. ' ' .. b .. ' ' .. now .. ' ' .. ARGV[6])
return 0
