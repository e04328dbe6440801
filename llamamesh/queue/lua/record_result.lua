-- KEYS: meta, done, results, ids, started, link. ARGV: custom_id, status, encoded result, now,
-- retention (s), fail_after, prompt, completion and cached tokens (added to the batch's usage).
-- Returns 1 (recorded), 2 (recorded, and it failed the batch: its first fail_after results all
-- errored), 3 (recorded, the batch's last: every item has its result), 0 (the item had a result
-- already: its status is written again, so that a WAIT after this call covers the first call's
-- write), -1 (no such batch: it was purged).
--! include batch_finish
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then
  redis.call('HSET', KEYS[2], ARGV[1], redis.call('HGET', KEYS[2], ARGV[1]))
  return 0
end
redis.call('XADD', KEYS[3], '*', 'r', ARGV[3])
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
if tonumber(ARGV[7]) > 0 then redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[7]) end
if tonumber(ARGV[8]) > 0 then redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[8]) end
if tonumber(ARGV[9]) > 0 then redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[9]) end
local ret = 1
if ARGV[2] == 'errored' and tonumber(ARGV[6]) > 0 then
  local f = redis.call('HMGET', KEYS[1], 'state', 'succeeded', 'errored')
  if f[1] == 'in_progress' and (tonumber(f[2]) or 0) == 0 and tonumber(f[3]) >= tonumber(ARGV[6]) then
    redis.call('HSET', KEYS[1], 'state', 'failed', 't:failed', ARGV[4])
    ret = 2
  end
end
if finish(ARGV[4], ARGV[5]) then return 3 end
return ret
