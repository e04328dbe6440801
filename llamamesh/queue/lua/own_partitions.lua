-- KEYS: the pool's owners hash, its partitions key. ARGV: the worker, its ttl (ms), P, mode
-- ("own": a ready worker's heartbeat; "leave": it stops leasing). Records P if none is (returns
-- {-1, P'} when another P' is: nothing changed), then affinity.assign's step (or, leaving, drops
-- the worker's membership and partitions). Returns {0, partitions owned...}. Time is Redis's own
-- (TIME).
local stored = redis.call('GET', KEYS[2])
if not stored then redis.call('SET', KEYS[2], ARGV[3]); stored = ARGV[3] end
if stored ~= ARGV[3] then return {-1, tonumber(stored) or -1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, ttl, P = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
local h = {}
for i = 1, #all, 2 do h[all[i]] = all[i + 1] end
local leaving = ARGV[4] == 'leave'
local live = 0
for f, v in pairs(h) do
  if string.sub(f, 1, 2) == 'm:' then
    if string.sub(f, 3) ~= me and tonumber(v) > now then live = live + 1
    elseif string.sub(f, 3) ~= me then redis.call('HDEL', KEYS[1], f) end
  end
end
if leaving then
  redis.call('HDEL', KEYS[1], 'm:' .. me)
else
  live = live + 1
  redis.call('HSET', KEYS[1], 'm:' .. me, now + ttl)
end
local mine, free, held = {}, {}, {}
for k = 0, P - 1 do
  local v = h[tostring(k)]
  if v then
    local sp = string.find(v, ' ', 1, true)
    local w, exp = string.sub(v, 1, sp - 1), tonumber(string.sub(v, sp + 1))
    if w == me then table.insert(mine, k)
    elseif exp <= now then table.insert(free, k)
    else held[w] = (held[w] or 0) + 1 end
  else
    table.insert(free, k)
  end
end
local target = 0
if not leaving then
  local quota, extra = math.floor(P / live), P % live
  local short = false
  for f, v in pairs(h) do
    if string.sub(f, 1, 2) == 'm:' and string.sub(f, 3) ~= me and tonumber(v) > now
       and (held[string.sub(f, 3)] or 0) < quota then short = true end
  end
  target = quota
  if extra > 0 and not short then target = quota + 1 end
end
local out = {0}
local held = 0
for _, k in ipairs(mine) do
  if held < target then
    redis.call('HSET', KEYS[1], tostring(k), me .. ' ' .. (now + ttl))
    held = held + 1
    table.insert(out, k)
  else
    redis.call('HDEL', KEYS[1], tostring(k))
  end
end
for _, k in ipairs(free) do
  if held >= target then break end
  redis.call('HSET', KEYS[1], tostring(k), me .. ' ' .. (now + ttl))
  held = held + 1
  table.insert(out, k)
end
return out
