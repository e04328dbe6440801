"""Prefix affinity: a pool's work split into partition streams, each owned by one of its workers.

With ``RedisSettings.affinity_partitions`` P > 0 every (pool, tenant) work stream becomes P
partition streams (``Keys.jobs_part``), a job's chosen by the hash of its prefix key
(``partition_of``). Each partition has one owner among the pool's ready workers, recorded in the
pool's owners hash (``Keys.owners``): ``"<k>" -> "<worker> <expiry ms>"``, beside each ready
worker's membership ``"m:<worker>" -> <expiry ms>``. Every heartbeat of a ready worker runs
``assign`` (``OWN``, its Lua twin, on Redis): it renews its membership and its partitions, takes
partitions that are unowned or whose owner's lease expired, and holds about ceil(P / members),
giving back extras so that a worker that joins gets its share (``share``: P // members each, the
remainder one more each). A dead worker's partitions expire
with its heartbeat TTL and go to the others at their next heartbeats.

A worker leases from its own partitions first (the tenants' fair share over them), then, only when
that gave nothing, takes the oldest jobs that waited at least ``affinity_steal_after_ms`` in the
others' (a steal: a job younger than that is left to its owner, which takes it at once if it has
room), and blocks on its own for at most that long: affinity never leaves a worker idle while work
waits for longer than about twice ``affinity_steal_after_ms``.
docs/affinity.md has the design and its trade-offs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from llamamesh.types import GenerationRequest

# Field prefix of a member's entry in the owners hash (partition fields are bare numbers).
MEMBER = "m:"


def partition_of(request: GenerationRequest, partitions: int) -> int:
    """The partition of a job among ``partitions`` (> 0): the hash (blake2b) of its prefix key, or
    of its request id when it has none (spread, no affinity)."""
    key = request.prefix_key or request.request_id
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


def share(partitions: int, live: int, short: bool) -> int:
    """How many partitions a worker may hold among ``live`` members: P // live, or one more while
    they do not divide evenly and no other member holds fewer than P // live (``short``), so that
    every member gets at least P // live and none waits with nothing while another holds extra."""
    quota, extra = divmod(partitions, live)
    return quota + 1 if extra and not short else quota


def assign(
    owners: Mapping[int, tuple[str, int]], members: Mapping[str, int], me: str, now_ms: int, ttl_ms: int,
    partitions: int,
) -> tuple[dict[int, tuple[str, int]], dict[str, int], list[int]]:  # fmt: skip
    """One ownership step of worker ``me`` (a ready worker's heartbeat): the new owners (partition
    -> (worker, expiry ms)), the new members (worker -> expiry ms, expired ones gone) and the
    partitions ``me`` owns now, in order. ``OWN`` is the same step on Redis."""
    live = {w: until for w, until in members.items() if until > now_ms}
    live[me] = now_ms + ttl_ms
    new: dict[int, tuple[str, int]] = {}
    mine: list[int] = []
    free: list[int] = []
    held: dict[str, int] = {}
    for k in range(partitions):
        owner = owners.get(k)
        if owner is not None and owner[0] == me:
            mine.append(k)
        elif owner is None or owner[1] <= now_ms:
            free.append(k)
        else:
            new[k] = owner
            held[owner[0]] = held.get(owner[0], 0) + 1
    target = share(partitions, len(live), any(held.get(w, 0) < partitions // len(live) for w in live if w != me))
    kept = mine[:target] + free[: max(0, target - len(mine))]
    for k in sorted(kept):
        new[k] = (me, now_ms + ttl_ms)
    return new, live, sorted(kept)


# KEYS: the pool's owners hash, its partitions key. ARGV: the worker, its ttl (ms), P, mode ("own":
# a ready worker's heartbeat; "leave": it stops leasing). Records P if none is (returns {-1, P'}
# when another P' is: nothing changed), then ``assign`` (or, leaving, drops the worker's membership
# and partitions). Returns {0, partitions owned...}. Time is Redis's own (``TIME``).
OWN = """
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
"""

# KEYS: the partitions key. ARGV: P. Records P if none is; returns the recorded P (a P of 0 records
# nothing: returns the recorded one, or 0).
CHECK = """
local stored = redis.call('GET', KEYS[1])
if not stored then
  if ARGV[1] == '0' then return 0 end
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return tonumber(stored) or -1
"""

# KEYS: work streams (of one tenant: some of its partitions). ARGV: group, consumer, n, least age
# (ms; a steal's: entries younger than that are left to their owner). Leases the n oldest new
# entries among them (by entry id, so one tenant's jobs go in submission order across its
# partitions) in one step. Returns {{index of the stream in KEYS, entry id, fields}...} and the
# indexes of streams (or groups) that are not there. An entry's age is Redis's clock (``TIME``)
# less its id's time (XADD's, also Redis's).
TAKE = """
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
"""
