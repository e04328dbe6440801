-- KEYS: the HTTP door's link of a batch, the batch's record (one slot: the batch's hash tag).
-- ARGV: its life (s) while the batch runs, now (unix s), then field, value, ... Writes the link for
-- that long; once the batch has ended (it may end before its link is written), only for what is
-- left of the batch's retention (batch_finish.lua gives the link that retention when it ends).
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
local until_at = tonumber(redis.call('HGET', KEYS[2], 'results_expire_at'))
local ttl = tonumber(ARGV[1])
if until_at then ttl = math.min(ttl, math.max(1, math.ceil(until_at - tonumber(ARGV[2])))) end
redis.call('EXPIRE', KEYS[1], ttl)
return ttl
