-- KEYS: work streams (of one tenant: some of its partitions). ARGV: group, consumer, n, least
-- age (ms; a steal's: entries younger than that are left to their owner). Leases the n oldest new
-- entries among them (by entry id, so one tenant's jobs go in submission order across its
-- partitions) in one step. Returns {{index of the stream in KEYS, entry id, fields}...} and the
-- indexes of streams (or groups) that are not there. An entry's age is Redis's clock (TIME) less
-- its id's time (XADD's, also Redis's).
local n = tonumber(ARGV[3])
local newest = math.huge
if tonumber(ARGV[4]) > 0 then
  local t = redis.call('TIME')
  newest = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[4])
end
local heads, lost = {}, {}
for i, k in ipairs(KEYS) do
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', k)
  local last = nil
  if ok then
    for _, g in ipairs(groups) do
      local f = {}
      for j = 1, #g, 2 do f[g[j]] = g[j + 1] end
      if f['name'] == ARGV[1] then last = f['last-delivered-id'] end
    end
  end
  if not last then
    table.insert(lost, i)
  else
    for _, e in ipairs(redis.call('XRANGE', k, '(' .. last, '+', 'COUNT', n)) do
      local dash = string.find(e[1], '-', 1, true)
      local ms = tonumber(string.sub(e[1], 1, dash - 1))
      if ms > newest then break end
      table.insert(heads, {ms, tonumber(string.sub(e[1], dash + 1)), i})
    end
  end
end
table.sort(heads, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return a[2] < b[2] end
  return a[3] < b[3]
end)
local per = {}
for j = 1, math.min(n, #heads) do per[heads[j][3]] = (per[heads[j][3]] or 0) + 1 end
local out = {}
for i, c in pairs(per) do
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', c, 'STREAMS', KEYS[i], '>')
  if reply then
    for _, e in ipairs(reply[1][2]) do table.insert(out, {i, e[1], e[2]}) end
  end
end
return {out, lost}
