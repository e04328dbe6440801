-- KEYS: the pool's lanes (a sorted set by deadline), its prefix holds (a hash), its shared batch
-- stream. ARGV: group, consumer, count (> 0), the lanes' key prefix (a lane is it and its batch
-- id), hold (ms), how many lanes to read the list by, the entries' prefix field. Leases up to
-- count new batch items: the shared stream's first, then the lanes' in deadline order. A lane whose next item continues
-- the prefix group of the last one leased from it is held for this consumer, for hold ms from the
-- lease that entered the group (never renewed): until then other consumers pass the lane by while
-- other lanes have items for them, and take of it only when none has (no consumer waits while items
-- do: a group taken over so is nobody's from then on); once it lapsed, any consumer leases the rest
-- of that group ("0 -" holds it for nobody). A hold is
-- "<until ms> <consumer>\n<prefix key>". A lane with nothing left to lease leaves the sorted set, in
-- this same step: an item queued after it adds the lane again. Returns {{batch id ('': the shared
-- stream), entry id, fields}...}. Redis's clock (TIME) times the holds.
local group, me, left = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}

local function read(stream, n)
  local ok, reply = pcall(redis.call, 'XREADGROUP', 'GROUP', group, me, 'COUNT', n, 'STREAMS', stream, '>')
  if not ok then return nil end
  if not reply then return {} end
  return reply[1][2]
end

local function prefix_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == ARGV[7] then return fields[i + 1] end
  end
  return nil
end

for _, e in ipairs(read(KEYS[3], left) or {}) do
  table.insert(out, {'', e[1], e[2]})
  left = left - 1
end

-- Leases from the lane listed as m (held for another consumer: passed by, unless take_over);
-- returns whether it stays listed, and whether it was passed by.
local function visit(m, take_over)
  local till, holder, held = 0, nil, nil
  local hold = redis.call('HGET', KEYS[2], m)
  if hold then
    local sp = string.find(hold, ' ', 1, true)
    local nl = string.find(hold, '\n', sp + 1, true)
    till, holder = tonumber(string.sub(hold, 1, sp - 1)), string.sub(hold, sp + 1, nl - 1)
    held = string.sub(hold, nl + 1)
  end
  local others = till > now and holder ~= me
  if others and not take_over then return true, true end
  local bid = string.sub(m, string.find(m, ':', 1, true) + 1)
  local lane = ARGV[4] .. bid
  local got = read(lane, left)
  if got == nil and redis.call('EXISTS', lane) == 1 then
    redis.call('XGROUP', 'CREATE', lane, group, '0')
    got = read(lane, left)
  end
  got = got or {}
  for _, e in ipairs(got) do table.insert(out, {bid, e[1], e[2]}) end
  local nxt = nil
  if #got > 0 and #got == left then
    nxt = redis.call('XRANGE', lane, '(' .. got[#got][1], '+', 'COUNT', 1)[1]
  end
  left = left - #got
  if not nxt then
    redis.call('ZREM', KEYS[1], m)
    redis.call('HDEL', KEYS[2], m)
    return false, false
  end
  local key = prefix_of(got[#got][2])
  if key and key == prefix_of(nxt[2]) then
    if key ~= held then  -- a group this lease entered: held for this consumer from now
      redis.call('HSET', KEYS[2], m, string.format('%d %s\n%s', now + tonumber(ARGV[5]), me, key))
    elseif (till > 0 and till <= now) or others then  -- lapsed or taken over: anyone's from now on
      redis.call('HSET', KEYS[2], m, '0 -\n' .. key)
    end
  else
    redis.call('HDEL', KEYS[2], m)
  end
  return true, false
end

-- Lanes in windows of ARGV[6]: a lane drained leaves the list, so the next window starts after
-- the ones still listed. At most ARGV[6] + count lanes looked at: each lane not held gives an item.
local size = tonumber(ARGV[6])
local start, looked, most = 0, 0, size + tonumber(ARGV[3])
local passed = {}
while left > 0 and looked < most do
  local window = redis.call('ZRANGE', KEYS[1], start, start + size - 1)
  for _, m in ipairs(window) do
    if left <= 0 or looked >= most then break end
    looked = looked + 1
    local listed, held = visit(m, false)
    if listed then start = start + 1 end
    if held then table.insert(passed, m) end
  end
  if #window < size then break end
end
-- Nothing else to lease: the groups held for others, rather than nothing.
for _, m in ipairs(passed) do
  if left <= 0 then break end
  visit(m, true)
end
return out
