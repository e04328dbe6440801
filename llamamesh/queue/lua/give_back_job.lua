-- KEYS: a work stream. ARGV: group, entry id. A job leased past the lease's count (a blocking
-- read of several streams that all got work at once) goes back to the end of its stream,
-- unleased: the entry is acked and deleted and its fields added again, in one step. Returns 1, or
-- 0 when it was gone already (a retried write whose first try was applied).
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #e == 0 then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
return 1
