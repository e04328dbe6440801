-- Leased items about to run. KEYS: meta, started. ARGV: now, custom_id ... Returns 'ok' (they
-- are marked started: no sweep ends them), 'expired' (past the deadline), or the state that stops
-- them.
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_at', 'closing')
if not f[1] then return 'gone' end
if f[1] ~= 'in_progress' then return f[1] end
if f[3] or tonumber(ARGV[1]) > tonumber(f[2]) then return 'expired' end
for i = 2, #ARGV do redis.call('SADD', KEYS[2], ARGV[i]) end
return 'ok'
