-- KEYS: a stream. ARGV: group, least idle time (ms). Deletes the group's consumers that hold no
-- entry and were idle that long; returns how many. One script: a consumer cannot lease an entry
-- between the look and the delete (XGROUP DELCONSUMER drops whatever the consumer holds).
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return 0 end
local n = 0
for _, c in ipairs(consumers) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    n = n + 1
  end
end
return n
