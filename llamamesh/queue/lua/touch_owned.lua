-- KEYS: a stream. ARGV: group, consumer, then entry ids. Resets the idle time of each entry that is
-- still pending under this consumer (XCLAIM, min idle 0) and returns the ids pending under another
-- one: taken over while this consumer could not touch them (paused, or cut off from Redis past the
-- claim idle time), which it must stop running. A plain XCLAIM would take them back, and both
-- consumers would run them. An entry pending under nobody (acked, deleted) is left alone.
-- A stream gone (with its group) has nothing to touch.
local lost = {}
for i = 3, #ARGV do
  local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if not ok then return lost end
  if p[1] then
    if p[1][2] == ARGV[2] then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      lost[#lost + 1] = ARGV[i]
    end
  end
end
return lost
