-- KEYS: meta. ARGV: now. Returns the state after the call ('' if there is no such batch). A
-- batch cancelling already (a retry) gets its state written again: a WAIT after this call covers
-- the first call's write.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return '' end
if state == 'in_progress' or state == 'validating' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 't:cancelling', ARGV[1])
  return 'cancelling'
end
if state == 'cancelling' then redis.call('HSET', KEYS[1], 'state', state) end
return state
