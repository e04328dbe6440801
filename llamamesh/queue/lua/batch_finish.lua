-- Included by record_result.lua and skip_unstarted.lua (KEYS: meta, done, results, ids,
-- started, the HTTP door's link): once every item has a result, end the batch (in_progress ->
-- completed or expired, cancelling -> cancelled; failed stays) and start its retention (of every
-- key). Returns true then.
local function finish(now, retention)
  local f = redis.call('HMGET', KEYS[1], 'total', 'succeeded', 'errored', 'cancelled', 'expired', 'state')
  local n = (tonumber(f[2]) or 0) + (tonumber(f[3]) or 0) + (tonumber(f[4]) or 0) + (tonumber(f[5]) or 0)
  if n < tonumber(f[1]) then return false end
  local final = nil
  if f[6] == 'in_progress' then
    final = 'completed'
    if (tonumber(f[5]) or 0) > 0 then final = 'expired' end
  elseif f[6] == 'cancelling' then final = 'cancelled'
  elseif f[6] ~= 'failed' then return false end
  if final then
    redis.call('HSET', KEYS[1], 't:finalizing', now, 'state', final, 't:' .. final, now)
  end
  redis.call('HSET', KEYS[1], 'results_expire_at', tonumber(now) + tonumber(retention))
  for i = 1, 6 do redis.call('EXPIRE', KEYS[i], retention) end
  return true
end
