-- A worker's events of one step in one command (a single server; a cluster's keys span slots).
-- ARGV[1] is the field, then per event (payload, ttl, attempt id): XADD, then EXPIRE when ttl > 0;
-- a terminal event (attempt id set) also has its caller's attempts record as its next key, which
-- then gets attempt_ended.lua's treatment. Returns how many keys it used. One reply instead of one
-- per command: in the pipeline of a few hundred XADDs every step, the client's per-reply cost was
-- most of the worker's publishing.
local k = 1
for a = 2, #ARGV, 3 do
  local key = KEYS[k]
  k = k + 1
  redis.call('XADD', key, '*', ARGV[1], ARGV[a])
  local ttl = tonumber(ARGV[a + 1])
  if ttl > 0 then
    redis.call('EXPIRE', key, ttl)
  end
  local attempt = ARGV[a + 2]
  if attempt ~= '' then
    local last = redis.call('LINDEX', KEYS[k], -1)
    if last and string.find(last, '"attempt_id": "' .. attempt .. '"', 1, true) then
      redis.call('EXPIRE', KEYS[k], ttl)
    end
    k = k + 1
  end
end
return k - 1
