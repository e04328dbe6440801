-- Included by the quota scripts: ``now``, Redis's own time in ms (TIME), not each gateway's.
local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
