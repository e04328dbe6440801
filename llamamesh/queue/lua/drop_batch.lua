-- KEYS: meta, then the batch's other keys. ARGV: now, least idle seconds. Drops an unsealed
-- batch nobody touched for that long: 1 (dropped), 0 (sealed: kept), -1 (touched lately), 2 (no
-- batch).
local f = redis.call('HMGET', KEYS[1], 'state', 'enqueued', 'touched')
if not f[1] then return 2 end
if f[2] then return 0 end
if tonumber(ARGV[1]) - (tonumber(f[3]) or 0) < tonumber(ARGV[2]) then return -1 end
redis.call('DEL', unpack(KEYS))
return 1
