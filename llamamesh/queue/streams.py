"""The queue on Redis Streams.

- Work: one stream per tenant with work in a pool (``keys.jobs(pool, tenant)``; the default
  tenant's is the pool's plain stream), listed with the tenant's weight in ``keys.tenants``, read
  by the pool's workers through one consumer group on each; a job is acked and deleted after its
  terminal event. A lease shares the workers between the tenants with jobs waiting by deficit
  round robin (``fair.FairShare``): pipelined non-blocking reads of each stream, and only when
  nothing waits anywhere one blocking read of all of them.
- Events: one stream per request (``keys.events``), written by the worker (one
  entry per engine step, all requests of a step in one pipeline) and read by
  the gateway with blocking XREAD from its last id, one XREAD for all the
  requests a gateway follows (``follow.EventFollower``). It expires
  ``event_ttl_s`` after the terminal event.
- Cancel: a flag key per request, checked when a job is leased and on every
  publish of the worker that runs it.
- Bounds: the dead-letter stream keeps ``dead_letter_maxlen`` entries; an event stream's idle TTL
  is renewed while its request publishes (``publish``); consumers that hold no entry and sat idle
  for ``consumer_idle_s`` leave the pool's groups (``prune_consumers``, from ``workers``), and a
  tenant's work stream that holds nothing leaves with its entry in ``keys.tenants`` (its next
  submission makes it again).

- Prefix affinity (``affinity_partitions`` > 0; llamamesh/queue/affinity.py, docs/affinity.md):
  each tenant's stream is split into partitions (``keys.jobs_part``) by the hash of the job's prefix
  key; the ready workers' heartbeats share out their ownership (``keys.owners``); a lease reads its
  own first and steals from the others only when idle. Off, nothing of it is made or read.

Redis errors become ``QueueUnavailable`` here and nowhere else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from typing import Any, TypeVar  # redis-py types stream replies loosely

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from llamamesh.errors import InvalidRequest, QueueFull, QueueMisconfigured, QueueUnavailable
from llamamesh.queue import affinity, codec
from llamamesh.queue.coalesce import ScriptPipe
from llamamesh.queue.fair import FairShare
from llamamesh.queue.follow import EventFollower, Item
from llamamesh.queue.keys import (
    CANCEL_AHEAD_TTL_S,
    EVENT_FIELD,
    JOB_FIELD,
    SUBMITTED_TTL_S,
    WORKER_GROUP,
    Keys,
    shard_tags,
    stream_tenant,
)
from llamamesh.queue.protocol import Lease, QueueDepth, entry_ref, split_ref
from llamamesh.queue.redisio import Replicas, call_scripts, connect, is_cluster, unreachable
from llamamesh.settings import RedisSettings
from llamamesh.types import Attempt, Failure, GenerationRequest, JobEvent, WorkerStatus

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


async def create_group(client: aioredis.Redis, stream: str) -> bool:
    """The workers' consumer group on ``stream`` (and the stream), unless it exists; True when it
    did not."""
    with unreachable("cannot create the consumer group"):
        try:
            await client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
    return True


# KEYS: the tenant's work stream (affinity on: the job's partition of it), the request's submitted
# marker, the pool's tenants hash, the pool's partitions key, and (affinity on) every partition of
# the tenant's stream. ARGV: job field, encoded job, max waiting (0: no bound), group, the marker's
# ttl, tenant, weight, the partitions P (0: off). Returns -1 (queued), -2 (queued before: a retried
# write whose first try was applied; nothing queued again, the marker's ttl set again: a write,
# so a WAIT after this one covers the first try's), -3 (the pool is partitioned otherwise:
# nothing queued), or how many wait unleased (the tenant's streams are full: nothing queued). A new
# stream gets the workers' group here (from its start; affinity on: every partition's at once), so
# no job is queued where no worker reads.
_SUBMIT = """
local stored = redis.call('GET', KEYS[4])
if ARGV[8] ~= '0' and not stored then redis.call('SET', KEYS[4], ARGV[8]); stored = ARGV[8] end
if (stored or '0') ~= ARGV[8] then return -3 end
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('EXPIRE', KEYS[2], ARGV[5])
  return -2
end
local streams = {KEYS[1]}
if #KEYS > 4 then
  streams = {}
  for i = 5, #KEYS do table.insert(streams, KEYS[i]) end
end
local most = tonumber(ARGV[3])
if most > 0 then
  local n = 0
  for _, s in ipairs(streams) do n = n + redis.call('XLEN', s) end
  if n >= most then
    local leased = 0
    for _, s in ipairs(streams) do
      local ok, summary = pcall(redis.call, 'XPENDING', s, ARGV[4])
      if ok then leased = leased + tonumber(summary[1]) end
    end
    if n - leased >= most then return n - leased end
  end
end
if #KEYS > 4 and redis.call('EXISTS', KEYS[1]) == 0 then
  for _, s in ipairs(streams) do pcall(redis.call, 'XGROUP', 'CREATE', s, ARGV[4], '0', 'MKSTREAM') end
end
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[4], '0', 'MKSTREAM')
redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[6], ARGV[7])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[5])
return -1
"""

# KEYS: the pool's tenants hash, a tenant's work stream (affinity on: each of its partitions).
# ARGV: the tenant, group. Forgets a tenant whose streams hold nothing (no entry, none leased);
# returns 1 if it did. One script, like _SUBMIT: a submission lands either before the look (kept)
# or after the delete (made again).
_FORGET = """
for i = 2, #KEYS do
  if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
  local ok, summary = pcall(redis.call, 'XPENDING', KEYS[i], ARGV[2])
  if ok and tonumber(summary[1]) > 0 then return 0 end
end
redis.call('HDEL', KEYS[1], ARGV[1])
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

# KEYS: the pool's tenants hash, a tenant's work stream (affinity on: each of its partitions). ARGV:
# the tenant, group. Makes the streams and groups of a tenant still listed (the default tenant
# always) when a read found them missing; returns 1 if it made any. One script, like _FORGET: a
# forgotten tenant's stream stays gone.
_REMAKE = """
if ARGV[1] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
local made = 0
for i = 2, #KEYS do
  if pcall(redis.call, 'XGROUP', 'CREATE', KEYS[i], ARGV[2], '0', 'MKSTREAM') then made = 1 end
end
return made
"""

# KEYS: a work stream. ARGV: group, entry id. A job leased past the lease's count (a blocking read
# of several streams that all got work at once) goes back to the end of its stream, unleased: the
# entry is acked and deleted and its fields added again, in one step. Returns 1, or 0 when it was
# gone already (a retried write whose first try was applied).
_GIVE_BACK = """
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #e == 0 then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
return 1
"""


# KEYS: a stream. ARGV: group, least idle time (ms). Deletes the group's consumers that hold no
# entry and were idle that long; returns how many. One script: a consumer cannot lease an entry
# between the look and the delete (XGROUP DELCONSUMER drops whatever the consumer holds).
_PRUNE = """
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return 0 end
local n = 0
for _, c in ipairs(consumers) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    n = n + 1
  end
end
return n
"""

# A leased entry as the lease path carries it: (tenant, entry id, request, partition or None, stolen).
_Leased = tuple[str, str, GenerationRequest, int | None, bool]

# A gateway prunes each pool's consumers at most this often (the pool's workers() is asked every
# probe interval).
PRUNE_EVERY_S = 60.0
# A request's event stream has its idle TTL renewed at most once per this fraction of the TTL.
RENEW_FRACTION = 0.25
# A worker reads its pool's tenants (``keys.tenants``) at most this often while it finds work, and
# again before each blocking read: a new tenant is seen within this, or within one block.
TENANTS_REFRESH_S = 0.5


def _id_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _gone(exc: BaseException) -> bool:
    """A read of a work stream that is not there (deleted with its group: Redis lost its data, or
    the tenant was forgotten, ``_FORGET``; a blocked read learns it as UNBLOCKED)."""
    return isinstance(exc, ResponseError) and ("NOGROUP" in str(exc) or "UNBLOCKED" in str(exc))


def _served(fair: FairShare, tenant: str, asked: int, entries: list[_T], candidates: set[str]) -> list[_T]:
    """A round's read of one tenant: the fair share learns what it gave; a tenant that gave fewer
    than asked is empty and leaves the round's candidates. Returns ``entries``."""
    fair.served(tenant, asked, len(entries))
    if len(entries) < asked:
        candidates.discard(tenant)
    return entries


async def prune_consumers(client: aioredis.Redis, stream: str, idle_ms: int) -> int:
    """Remove the workers' group consumers of ``stream`` that hold no entry and were idle for
    ``idle_ms`` or more (a missing stream or group: none); returns how many. Nothing leased is lost:
    a consumer holding entries stays. Raises QueueUnavailable."""
    with unreachable():
        return int(await client.eval(_PRUNE, 1, stream, WORKER_GROUP, idle_ms))


async def touch_entries(client: aioredis.Redis, stream: str, consumer: str, entry_ids: Sequence[str]) -> None:
    """Reset the idle time of the entries ``consumer`` still works on, so that nobody reclaims them."""
    if not entry_ids:
        return
    with unreachable():
        await client.xclaim(stream, WORKER_GROUP, consumer, 0, list(entry_ids), justid=True)


# KEYS: the request's attempts list. ARGV: the encoded attempt, first ('1': only if none yet), ttl.
# A record equal to the last one is a retried write whose first try was applied: done already.
_BEGIN = """
if redis.call('LINDEX', KEYS[1], -1) == ARGV[1] then return 1 end
local fresh = redis.call('EXISTS', KEYS[1]) == 0
if ARGV[2] == '1' and not fresh then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if fresh then
  local off = redis.call('GET', KEYS[2])
  if off == 'a' then redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
  elseif off then redis.call('DEL', KEYS[2]) end
end
return 1
"""

# KEYS: the caller's attempts list, its called-off flag. ARGV: the flag's life for an id not in use.
# A Cancel holds while the request's record lives (the same TTL); for an id with no record yet it
# holds a short while ('a', ahead of its Generate), which _BEGIN turns into the request's own.
_CALL_OFF = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('SET', KEYS[2], '1', 'PX', ttl)
else redis.call('SET', KEYS[2], 'a', 'EX', ARGV[1]) end
return 0
"""


# KEYS: the caller's attempts list. ARGV: the id of an attempt that just ended, ttl. When it is the
# latest attempt, the record now lives as long as the events do (Attach to it: NOT_FOUND after).
_ENDED = """
local last = redis.call('LINDEX', KEYS[1], -1)
if last and string.find(last, '"attempt_id": "' .. ARGV[1] .. '"', 1, true) then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


# A worker's events of one step in one command (a single server; a cluster's keys span slots):
# ARGV[1] is the field, then per event (payload, ttl, attempt id): XADD, then EXPIRE when ttl > 0;
# a terminal event (attempt id set) also has its caller's attempts record as its next key, which
# then gets _ENDED's treatment. One reply instead of one per command: in the pipeline of a few
# hundred XADDs every step, the client's per-reply cost was most of the worker's publishing.
_APPEND = """
local k = 1
for a = 2, #ARGV, 3 do
  local key = KEYS[k]
  k = k + 1
  redis.call('XADD', key, '*', ARGV[1], ARGV[a])
  local ttl = tonumber(ARGV[a + 1])
  if ttl > 0 then
    redis.call('EXPIRE', key, ttl)
  end
  local attempt = ARGV[a + 2]
  if attempt ~= '' then
    local last = redis.call('LINDEX', KEYS[k], -1)
    if last and string.find(last, '"attempt_id": "' .. attempt .. '"', 1, true) then
      redis.call('EXPIRE', KEYS[k], ttl)
    end
    k = k + 1
  end
end
return k - 1
"""


class RedisQueue:
    """Both faces of the queue (JobQueue and WorkQueue) on one Redis connection pool."""

    def __init__(
        self, client: aioredis.Redis, settings: RedisSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._r = client
        self._s = settings
        self.keys = Keys(settings.prefix, settings.event_shards)
        shard_tags(settings.event_shards)  # a bad count fails here, at start, not at the first request
        self.replicas = Replicas.of(settings)
        self._clock = clock
        # pool -> when its consumers were last pruned (clock seconds)
        self._pruned: dict[str, float] = {}
        # request id -> when its event stream's idle TTL is due for renewal (clock seconds); an
        # entry leaves with the request's terminal event, or once overdue by a whole TTL (a job
        # given up without one), looked for every quarter TTL.
        self._renew_at: dict[str, float] = {}
        self._forget_at = 0.0
        self._follower: EventFollower | None = None
        # pool -> the fair share of its tenants (deficit round robin), for this process's leases
        self._fair: dict[str, FairShare] = {}
        self._submit = client.register_script(_SUBMIT)
        self._forget = client.register_script(_FORGET)
        self._give_back = client.register_script(_GIVE_BACK)
        self._remake = client.register_script(_REMAKE)
        self._begin = client.register_script(_BEGIN)
        self._call_off = client.register_script(_CALL_OFF)
        self._ended = client.register_script(_ENDED)
        self._cluster = is_cluster(client)
        # A new request's two scripts (attempt record, submission), from every request arriving
        # together, in one pipeline each (coalesce.py); the submission's WAITs for replicas.
        self._records = ScriptPipe(client)
        self._submissions = ScriptPipe(client, self.replicas)
        if settings.affinity_partitions < 0:
            raise ValueError(f"affinity_partitions must be 0 (off) or more, not {settings.affinity_partitions}")
        # Prefix affinity (llamamesh/queue/affinity.py): partitions per work stream (0: off), and
        # (pool, worker) -> the partitions it owned at its last heartbeat.
        self._parts = settings.affinity_partitions
        self._owned: dict[tuple[str, str], list[int]] = {}
        self._own = client.register_script(affinity.OWN)
        self._check_parts = client.register_script(affinity.CHECK)
        self._take = client.register_script(affinity.TAKE)

    @property
    def client(self) -> aioredis.Redis:
        """The connection pool, for the batch store (llamamesh/queue/batches.py) to share."""
        return self._r

    @classmethod
    def from_settings(cls, settings: RedisSettings) -> RedisQueue:
        return cls(connect(settings), settings)

    # ---- gateway side -------------------------------------------------------
    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be positive, not {weight!r}")
        tenant = stream_tenant(request.tenant)
        partition = affinity.partition_of(request, self._parts) if self._parts else None
        every = self._streams_of(pool, tenant) if self._parts else []
        with unreachable():
            replies = await self._submissions.call(
                self._submit,
                keys=[self.keys.work(pool, tenant, partition), self.keys.submitted(pool, request.request_id),
                      self.keys.tenants(pool), self.keys.partitions(pool), *every],
                args=[JOB_FIELD, codec.encode_job(request), max_waiting, WORKER_GROUP,
                      min(SUBMITTED_TTL_S, self._s.event_idle_ttl_s), tenant, repr(float(weight)), self._parts],
            )  # fmt: skip
        waiting = int(replies[0])
        if waiting == -3:
            await self._misconfigured(pool)
        if waiting >= 0:
            whose = f"tenant {tenant!r} has" if tenant else "has"
            raise QueueFull(f"pool {pool!r} {whose} {waiting} requests waiting (at most {max_waiting}); retry later")
        self.replicas.check(replies, "the submission")

    async def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        async for item in self._followed(request_id, after, None):
            if item is not None:
                yield item

    def events_within(
        self, request_id: str, idle_s: float, after: str = "0-0"
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        return self._followed(request_id, after, idle_s)

    async def _followed(
        self, request_id: str, after: str, idle_s: float | None
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        if self._follower is None:
            self._follower = EventFollower(
                self._r, self.keys, self._s.block_ms, self._s.event_idle_ttl_s, self._s.outage_grace_s
            )
        sub = await self._follower.follow(self.keys.events(request_id), after)
        inbox = sub.queue
        held: Item | None = None
        try:
            while True:
                if held is not None:
                    item, held = held, None
                elif idle_s is None:
                    item = await inbox.get()
                else:
                    got = await inbox.get_within(idle_s)
                    if got is None:
                        yield None
                        continue
                    item = got
                entry_id, event = self._decoded(item)
                # A reader that fell behind gets what queued up meanwhile as one event (as vLLM's
                # output collector merges deltas), so it catches up instead of lagging further.
                # A failure is never merged: the tokens before it are delivered first.
                run = [event]
                while not run[-1].terminal and not sub.queue.empty():
                    item = sub.queue.get_nowait()
                    if isinstance(item, BaseException):
                        held = item
                        break
                    next_id, later = self._decoded(item)
                    if later.failed is not None or not run[-1].follows_on(later):
                        # A failure, or an event that does not follow on (a repeat the worker's
                        # retried publish wrote, or a gap): delivered on its own, for the relay's
                        # stream invariant (services/relay.py) to judge.
                        held = item
                        break
                    entry_id = next_id
                    run.append(later)
                event = JobEvent.joined(run)
                yield entry_id, event
                if event.terminal:
                    return
        finally:
            self._follower.unfollow(sub)

    @staticmethod
    def _decoded(item: Item) -> tuple[str, JobEvent]:
        if isinstance(item, BaseException):
            raise QueueUnavailable("the queue is unreachable") from item
        entry_id, fields = item
        return entry_id, codec.decode_event(fields[EVENT_FIELD.encode()])

    async def cancel(self, request_id: str) -> None:
        with unreachable():
            await self._r.set(self.keys.cancel(request_id), b"1", ex=self._s.event_idle_ttl_s)

    async def call_off(self, caller_id: str) -> None:
        keys = [self.keys.attempts(caller_id), self.keys.called_off(caller_id)]
        with unreachable():
            replies = await self.replicas.script(self._r, self._call_off, keys, [CANCEL_AHEAD_TTL_S])
        self.replicas.check(replies, "the cancel")

    async def epoch(self) -> str:
        with unreachable():
            value: Any = await self._r.get(self.keys.epoch())
            if value is None:  # (a read first: a full Redis refuses the write even when the key is there)
                await self._r.set(self.keys.epoch(), f"{uuid.uuid4().hex}@{time.time():.0f}", nx=True)
                value = await self._r.get(self.keys.epoch())
        return value.decode() if value else ""

    async def check_writes(self) -> None:
        with unreachable():
            await self._r.set(self.keys.write_probe(), b"1", ex=60)

    async def ping(self) -> None:
        with unreachable():
            await self._r.ping()

    async def workers(self, pool: str) -> list[WorkerStatus]:
        """The pool's live workers; stale names are forgotten, and at most every ``PRUNE_EVERY_S`` the
        pool's idle consumers too (``prune_consumers``). Raises QueueUnavailable."""
        if self._s.consumer_idle_s > 0:
            now = self._clock()
            if now - self._pruned.get(pool, -PRUNE_EVERY_S) >= min(PRUNE_EVERY_S, self._s.consumer_idle_s):
                self._pruned[pool] = now
                await self.prune_consumers(pool)
        names_key = self.keys.workers(pool)
        with unreachable():
            members: Any = await self._r.smembers(names_key)
            names = sorted(n.decode() for n in members)
            if not names:
                return []
            raw: Any = await self._r.mget([self.keys.worker(pool, n) for n in names])
            gone = [n for n, v in zip(names, raw, strict=True) if v is None]
            if gone:  # their heartbeats expired: forget the names too
                await self._r.srem(names_key, *gone)
        return [codec.decode_status(v) for v in raw if v is not None]

    async def queue_depth(self, pool: str) -> QueueDepth:
        """The pool's tenants (``keys.tenants``), then one pipeline of XLEN and the group's XPENDING
        summary of each of their work streams: an entry stays in its stream until acked, so waiting
        = length - leased. A stream or group not there counts as empty. Raises QueueUnavailable."""
        tenants = sorted((await self._read_tenants(pool)).keys() | {""})
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                for t, k in self._where(tenants):
                    stream = self.keys.work(pool, t, k)
                    pipe.xlen(stream)
                    pipe.xpending(stream, WORKER_GROUP)
                replies = await pipe.execute(raise_on_error=False)
        waiting = leased = 0
        for length, summary in zip(replies[::2], replies[1::2], strict=True):
            if isinstance(length, BaseException):
                raise QueueUnavailable("cannot read the work stream") from length
            held = 0
            if isinstance(summary, BaseException):
                if not _gone(summary):  # NOGROUP: the stream or its group is not there
                    raise QueueUnavailable("cannot read the work stream") from summary
            else:
                held = int(summary["pending"])
            waiting += max(0, int(length) - held)
            leased += held
        return QueueDepth(waiting, leased)

    async def prune_consumers(self, pool: str) -> int:
        """Remove the consumers of the pool's work streams (every tenant's) and batch stream that
        hold no entry and were idle for ``consumer_idle_s`` (dead or restarted workers' names);
        returns how many. Then forget the tenants whose work stream holds nothing (``_FORGET``).
        Raises QueueUnavailable."""
        idle_ms = self._s.consumer_idle_s * 1000
        tenants = sorted((await self._read_tenants(pool)).keys() | {""})
        n = 0
        for stream in (*(self.keys.work(pool, t, k) for t, k in self._where(tenants)), self.keys.batch_items(pool)):
            n += await prune_consumers(self._r, stream, idle_ms)
        if n:
            log.info("consumers_pruned", pool=pool, count=n, idle_s=self._s.consumer_idle_s)
        forgotten = []
        with unreachable():
            for t in tenants:
                if t and int(await self._forget(keys=[self.keys.tenants(pool), *self._streams_of(pool, t)],
                                                args=[t, WORKER_GROUP])):  # fmt: skip
                    forgotten.append(t)
        if forgotten:
            log.info("tenants_idle", pool=pool, tenants=forgotten)
        return n

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()
            self._follower = None
        await self._records.close()
        await self._submissions.close()
        await self._r.aclose()

    # ---- worker side --------------------------------------------------------
    async def join(self, pool: str) -> None:
        """Also records the pool's affinity partitions (affinity on), or checks that it has none
        recorded (off): QueueMisconfigured when they differ."""
        with unreachable():
            stored = int(await self._check_parts(keys=[self.keys.partitions(pool)], args=[self._parts]))
        if stored != self._parts:
            await self._misconfigured(pool)
        for stream in self._streams_of(pool, ""):
            await create_group(self._r, stream)

    def _streams_of(self, pool: str, tenant: str) -> list[str]:
        """Every work stream of a tenant of the pool: its partitions (affinity on), else its one."""
        if not self._parts:
            return [self.keys.jobs(pool, tenant)]
        return [self.keys.jobs_part(pool, tenant, k) for k in range(self._parts)]

    def _where(self, tenants: Sequence[str]) -> list[tuple[str, int | None]]:
        """(tenant, partition or None) of every work stream of ``tenants``."""
        parts: Sequence[int | None] = range(self._parts) if self._parts else [None]
        return [(t, k) for t in tenants for k in parts]

    async def _misconfigured(self, pool: str) -> None:
        """Raise QueueMisconfigured: the pool's recorded partitions are not this process's."""
        with unreachable():
            raw: Any = await self._r.get(self.keys.partitions(pool))
        stored = raw.decode() if raw else "0"
        log.error("affinity_mismatch", pool=pool, recorded=stored, configured=self._parts)
        raise QueueMisconfigured(
            f"pool {pool!r} is split into {stored} affinity partitions, this process into {self._parts} "
            "(LLAMAMESH_REDIS_AFFINITY_PARTITIONS must be the same on the pool's gateways and workers)"
        )

    async def lease(
        self, pool: str, consumer: str, count: int, block_ms: int, exclude: Collection[str] = ()
    ) -> list[Lease]:
        """Rounds of non-blocking reads, one pipeline each, of the streams of the tenants that may
        have jobs waiting (less ``exclude``), asking each what the fair share plans
        (``fair.FairShare``), until ``count`` jobs are leased or every stream came up short; only
        when nothing was leased and ``block_ms`` > 0, one blocking read of those streams for
        ``block_ms``. Never more than ``count`` jobs. A stream or group Redis lost is made again
        (NOGROUP: logged as an error for the default stream). Raises QueueUnavailable."""
        if count <= 0:
            return []
        fair = await self._fair_share(pool)
        if self._parts:
            got = await self._lease_parts(pool, consumer, count, block_ms, fair, exclude)
        else:
            plain = await self._lease_streams(pool, consumer, count, block_ms, fair, exclude)
            got = [(t, None, eid, f, False) for t, eid, f in plain]
        leased: list[_Leased] = []
        bad: dict[tuple[str, int | None], list[str]] = {}
        for tenant, k, eid, fields, stolen in got:
            try:
                leased.append((tenant, eid, codec.decode_job(fields[JOB_FIELD.encode()]), k, stolen))
            except (InvalidRequest, KeyError):
                log.error("job_undecodable", pool=pool, tenant=tenant, entry_id=eid)
                bad.setdefault((tenant, k), []).append(eid)
        for (tenant, k), eids in bad.items():
            await self._drop(self.keys.work(pool, tenant, k), eids)
        return await self._with_cancel_flags(pool, leased)

    async def _lease_streams(
        self, pool: str, consumer: str, count: int, block_ms: int, fair: FairShare, exclude: Collection[str]
    ) -> list[tuple[str, str, Any]]:
        """Affinity off: the rounds over every tenant's stream, then one blocking read."""
        got = await self._rounds(pool, consumer, count, fair, set(fair.tenants) - set(exclude))
        if not got:  # before blocking, a tenant that came meanwhile gets its read first
            before = set(fair.tenants)
            await self._refresh_tenants(pool, fair)
            if fresh := set(fair.tenants) - before - set(exclude):
                got = await self._rounds(pool, consumer, count, fair, fresh)
        if not got and block_ms > 0:
            got = await self._block(pool, consumer, count, block_ms, fair, exclude)
        return got

    async def _lease_parts(
        self, pool: str, consumer: str, count: int, block_ms: int, fair: FairShare, exclude: Collection[str]
    ) -> list[tuple[str, int | None, str, Any, bool]]:
        """Affinity on: the fair share's rounds over the tenants' partitions this consumer owns
        (its last heartbeat says which); only if they gave nothing, one round over the others' (a
        steal: the oldest jobs that waited there ``affinity_steal_after_ms`` or more, so an owner
        with room gets its own first); only if that gave nothing either, a blocking read of its own
        for at most ``affinity_steal_after_ms`` (owning none: a wait as long), and again from the
        start until ``block_ms`` is over: a busy owner's queued job is stolen by an idle worker
        within about twice ``affinity_steal_after_ms``."""
        deadline = self._clock() + block_ms / 1000
        while True:  # its partitions as its latest heartbeat left them
            owned = self._owned.get((pool, consumer), [])
            others = [k for k in range(self._parts) if k not in owned]
            got: list[tuple[str, int | None, str, Any, bool]] = []
            if owned:
                got = await self._part_rounds(pool, consumer, count, fair, set(fair.tenants) - set(exclude), owned)
            if not got:  # a tenant that came meanwhile gets its read first
                before = set(fair.tenants)
                await self._refresh_tenants(pool, fair)
                if owned and (fresh := set(fair.tenants) - before - set(exclude)):
                    got = await self._part_rounds(pool, consumer, count, fair, fresh, owned)
            if not got and others:
                got = await self._part_rounds(pool, consumer, count, fair, set(fair.tenants) - set(exclude),
                                              others, stolen=True)  # fmt: skip
            left_ms = int((deadline - self._clock()) * 1000)
            if got or block_ms <= 0 or left_ms <= 0:
                return got
            wait = min(left_ms, max(1, self._s.affinity_steal_after_ms))
            if owned:
                got = await self._part_block(pool, consumer, count, wait, fair, exclude, owned)
            else:  # nothing of its own to wait on: look at the others' again after as long
                await asyncio.sleep(wait / 1000)
            if got:
                return got

    async def _part_rounds(
        self, pool: str, consumer: str, count: int, fair: FairShare, candidates: set[str], partitions: list[int],
        stolen: bool = False,
    ) -> list[tuple[str, int | None, str, Any, bool]]:  # fmt: skip
        """``_rounds`` over the ``partitions`` of each tenant's stream: what the plan asks of a
        tenant is the oldest jobs among those partitions (``affinity.TAKE``, one script a tenant);
        ``stolen`` (others' partitions): only jobs that waited ``affinity_steal_after_ms``."""
        got: list[tuple[str, int | None, str, Any, bool]] = []
        lost: set[str] = set()
        age = max(1, self._s.affinity_steal_after_ms) if stolen else 0
        while len(got) < count and candidates:
            asks = fair.plan(count - len(got), candidates)
            with unreachable("cannot read the work stream"):
                replies = await call_scripts(self._r, [
                    (self._take, [self.keys.jobs_part(pool, tenant, k) for k in partitions],
                     [WORKER_GROUP, consumer, n, age])
                    for tenant, n in asks.items()
                ])  # fmt: skip
            for (tenant, n), reply in zip(asks.items(), replies, strict=True):
                if isinstance(reply, BaseException):
                    raise QueueUnavailable(f"cannot read the work stream: {reply}") from reply
                taken, missing = reply
                if missing:
                    lost.add(tenant)
                entries: list[tuple[str, int | None, str, Any, bool]] = [
                    (tenant, partitions[int(i) - 1], eid.decode(), dict(zip(f[::2], f[1::2], strict=True)), stolen)
                    for i, eid, f in taken
                ]
                entries.sort(key=lambda e: _id_order(e[2]))  # oldest first (ids of one ms: any order)
                got += _served(fair, tenant, n, entries, candidates)
        if lost:
            await self._recover(pool, fair, lost)
        return got

    async def _part_block(
        self, pool: str, consumer: str, count: int, block_ms: int, fair: FairShare, exclude: Collection[str],
        partitions: list[int],
    ) -> list[tuple[str, int | None, str, Any, bool]]:  # fmt: skip
        """``_block`` over the ``partitions`` of every tenant's stream (but ``exclude``'s)."""
        streams = {self.keys.jobs_part(pool, t, k): (t, k) for t in fair.tenants if t not in exclude
                   for k in partitions}  # fmt: skip
        if not streams:
            return []
        each = max(1, count // len(streams))
        with unreachable("cannot read the work stream"):
            try:
                reply: Any = await self._r.xreadgroup(WORKER_GROUP, consumer, dict.fromkeys(streams, ">"),
                                                      count=each, block=block_ms)  # fmt: skip
            except ResponseError as exc:
                if not _gone(exc):
                    raise
                await self._recover(pool, fair, set(fair.tenants))
                return []
        got: list[tuple[str, int | None, str, Any, bool]] = [
            (*streams[s.decode()], e.decode(), f, False) for s, es in reply or () for e, f in es
        ]
        if len(got) > count:
            with unreachable():
                for tenant, k, eid, _f, _s in got[count:]:
                    await self._give_back(keys=[self.keys.work(pool, tenant, k)], args=[WORKER_GROUP, eid])
            got = got[:count]
        return got

    async def _fair_share(self, pool: str) -> FairShare:
        """The pool's fair share, its tenants read again if older than ``TENANTS_REFRESH_S``."""
        fair = self._fair.setdefault(pool, FairShare())
        if fair.read_at is None or self._clock() - fair.read_at >= TENANTS_REFRESH_S:
            await self._refresh_tenants(pool, fair)
        return fair

    async def _refresh_tenants(self, pool: str, fair: FairShare) -> None:
        fair.set_tenants(await self._read_tenants(pool), self._clock())

    async def _read_tenants(self, pool: str) -> dict[str, float]:
        """tenant -> weight from the pool's tenants hash (an unreadable weight: 1.0)."""
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.tenants(pool))
        weights = {}
        for t, w in raw.items():
            try:
                weights[t.decode()] = float(w)
            except ValueError:
                weights[t.decode()] = 1.0
        return weights

    async def _rounds(
        self, pool: str, consumer: str, count: int, fair: FairShare, candidates: set[str]
    ) -> list[tuple[str, str, Any]]:
        """Non-blocking leases by the fair share's plan until ``count`` or no candidate is left;
        (tenant, entry id, fields) each."""
        got: list[tuple[str, str, Any]] = []
        lost: set[str] = set()
        while len(got) < count and candidates:
            asks = fair.plan(count - len(got), candidates)
            with unreachable("cannot read the work stream"):
                async with self._r.pipeline(transaction=False) as pipe:
                    for tenant, n in asks.items():
                        pipe.xreadgroup(WORKER_GROUP, consumer, {self.keys.jobs(pool, tenant): ">"}, count=n)
                    replies = await pipe.execute(raise_on_error=False)
            for (tenant, n), reply in zip(asks.items(), replies, strict=True):
                if isinstance(reply, BaseException):
                    if not _gone(reply):
                        raise QueueUnavailable(f"cannot read the work stream: {reply}") from reply
                    lost.add(tenant)
                    reply = None
                got += _served(fair, tenant, n, [(tenant, e.decode(), f) for _s, es in reply or () for e, f in es],
                               candidates)  # fmt: skip
        if lost:
            await self._recover(pool, fair, lost)
        return got

    async def _block(
        self, pool: str, consumer: str, count: int, block_ms: int, fair: FairShare, exclude: Collection[str] = ()
    ) -> list[tuple[str, str, Any]]:
        """One blocking read of every tenant's stream (but ``exclude``'s), a few jobs of each
        (``count`` shared out); a race that fills several streams at once may return more than
        ``count``: those go back."""
        streams = {self.keys.jobs(pool, t): t for t in fair.tenants if t not in exclude}
        if not streams:
            return []
        each = max(1, count // len(streams))
        with unreachable("cannot read the work stream"):
            try:
                reply: Any = await self._r.xreadgroup(WORKER_GROUP, consumer, dict.fromkeys(streams, ">"),
                                                      count=each, block=block_ms)  # fmt: skip
            except ResponseError as exc:
                if not _gone(exc):
                    raise
                await self._recover(pool, fair, set(fair.tenants))
                return []
        got = [(streams[s.decode()], e.decode(), f) for s, es in reply or () for e, f in es]
        if len(got) > count:
            with unreachable():
                for tenant, eid, _f in got[count:]:
                    await self._give_back(keys=[self.keys.jobs(pool, tenant)], args=[WORKER_GROUP, eid])
            got = got[:count]
        return got

    async def _recover(self, pool: str, fair: FairShare, lost: set[str]) -> None:
        """Streams that were not there when read: make again those of tenants still listed (a
        forgotten tenant's stays gone), saying so loudly for the default stream (Redis came back
        without its data: the gateways' readiness goes NOT_SERVING on the same loss)."""
        for tenant in sorted(lost):
            with unreachable("cannot create the consumer group"):
                made = int(await self._remake(keys=[self.keys.tenants(pool), *self._streams_of(pool, tenant)],
                                              args=[tenant, WORKER_GROUP]))  # fmt: skip
            if made and not tenant:
                log.error("consumer_group_missing", pool=pool, detail="Redis lost the work stream; recreating it")
        await self._refresh_tenants(pool, fair)

    async def _with_cancel_flags(self, pool: str, leased: list[_Leased], reclaimed: bool = False) -> list[Lease]:
        """Leases of (tenant, entry id, request, partition, stolen) with their cancel flags;
        ``reclaimed``: also whether each had begun (events exist)."""
        if not leased:
            return []
        requests = [req for _t, _eid, req, _k, _s in leased]
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                n_flags = self._check_cancelled(pipe, requests)
                if reclaimed:
                    for req in requests:
                        pipe.exists(self.keys.events(req.request_id))
                flags = await pipe.execute()
        gone = self._cancelled(requests, flags[:n_flags])
        begun = flags[n_flags:]
        return [Lease(pool=pool, entry_id=eid, request=req, cancelled=req.request_id in gone,
                      started=bool(begun[i]) if reclaimed else False, tenant=tenant, partition=k, stolen=stolen)
                for i, (tenant, eid, req, k, stolen) in enumerate(leased)]  # fmt: skip

    def _check_cancelled(self, pipe: Any, requests: Sequence[GenerationRequest]) -> int:
        """Queue the commands that tell whether each request is cancelled; return how many replies
        they make. One MGET of both flags of every request (the flags are strings: SET ... 1); on a
        cluster, whose keys span slots, two EXISTS each."""
        if not requests:
            return 0
        if not self._cluster:
            k = self.keys
            pipe.mget([key for req in requests for key in (k.cancel(req.request_id), k.called_off(req.caller_id))])
            return 1
        for req in requests:
            pipe.exists(self.keys.cancel(req.request_id))
            pipe.exists(self.keys.called_off(req.caller_id))
        return 2 * len(requests)

    def _cancelled(self, requests: Sequence[GenerationRequest], replies: Sequence[Any]) -> set[str]:
        """The request ids among ``requests`` that are cancelled, from _check_cancelled's replies."""
        if not requests:
            return set()
        flags = replies if self._cluster else replies[0]
        return {req.request_id for i, req in enumerate(requests) if flags[2 * i] or flags[2 * i + 1]}

    async def reclaim(
        self, pool: str, consumer: str, min_idle_ms: int, count: int, max_deliveries: int, own: bool = False,
        running: Collection[str] = (),
    ) -> list[Lease]:  # fmt: skip
        """Each of the pool's work streams (every tenant's): XPENDING, then XCLAIM of up to ``count``
        stale entries in all, one pipeline each."""
        where = self._where((await self._fair_share(pool)).tenants)
        with unreachable("cannot reclaim from the work stream"):
            async with self._r.pipeline(transaction=False) as pipe:
                for t, k in where:
                    pipe.xpending_range(
                        self.keys.work(pool, t, k), WORKER_GROUP, min="-", max="+", count=count,
                        consumername=consumer if own else None, idle=None if own else min_idle_ms,
                    )  # fmt: skip
                pending = await pipe.execute(raise_on_error=False)
            # (tenant, partition) -> entry id -> its delivery count once claimed
            delivered: dict[tuple[str, int | None], dict[str, int]] = {}
            n = 0
            for (t, k), stale in zip(where, pending, strict=True):
                if isinstance(stale, BaseException):
                    if not _gone(stale):
                        raise stale
                    continue
                for p in stale:
                    eid = p["message_id"].decode()
                    # its own idle ones too, unless it runs them (a lease whose reply was lost)
                    if n < count and (own or entry_ref(t, eid, k) not in running):
                        delivered.setdefault((t, k), {})[eid] = int(p["times_delivered"]) + 1
                        n += 1
            if not delivered:
                return []
            # XCLAIM with a minimum idle time: of several reclaimers, the first one resets the
            # idle time and takes the job; the others get nothing for it.
            async with self._r.pipeline(transaction=False) as pipe:
                for (t, k), ids in delivered.items():
                    pipe.xclaim(self.keys.work(pool, t, k), WORKER_GROUP, consumer, 0 if own else min_idle_ms,
                                list(ids))  # fmt: skip
                claims = await pipe.execute(raise_on_error=False)
        entries: list[tuple[str, int | None, str, Any]] = []
        for (t, k), claimed in zip(delivered, claims, strict=True):
            if isinstance(claimed, BaseException):
                if not _gone(claimed):
                    raise QueueUnavailable(f"cannot reclaim from the work stream: {claimed}") from claimed
                continue
            entries += [(t, k, eid.decode(), fields) for eid, fields in claimed if fields]
        leases: list[_Leased] = []
        for t, k, eid, fields in entries:
            try:
                req = codec.decode_job(fields[JOB_FIELD.encode()])
            except (InvalidRequest, KeyError):
                await self._drop(self.keys.work(pool, t, k), [eid])
                continue
            times = delivered[(t, k)].get(eid, 1)
            if times > max_deliveries:
                await self.dead_letter(pool, eid, req, f"the {times - 1} workers that took it died", times, tenant=t,
                                       partition=k)  # fmt: skip
            else:
                leases.append((t, eid, req, k, False))
        log.info("jobs_reclaimed", pool=pool, count=len(leases), dead=len(entries) - len(leases), own=own)
        return await self._with_cancel_flags(pool, leases, reclaimed=True)

    async def dead_letter(
        self, pool: str, entry_id: str, request: GenerationRequest, reason: str, deliveries: int, tenant: str = "",
        partition: int | None = None,
    ) -> None:  # fmt: skip
        """Move a poison job to the pool's dead-letter stream (with ``reason``), tell its caller
        (a terminal failure on its events), and drop it from its work stream (``tenant``'s, or its
        ``partition`` of it)."""
        stream = self.keys.work(pool, tenant, partition)
        failed = JobEvent(failed=Failure(code="set_aside", message=f"the job was set aside: {reason}", retryable=False))
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                self._dead_record(pipe, pool, request, reason, deliveries)
                events = self.keys.events(request.request_id)
                pipe.xadd(events, {EVENT_FIELD: codec.encode_event(failed)})
                pipe.expire(events, self._s.event_ttl_s)
                pipe.xack(stream, WORKER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                await pipe.execute()
        log.error("job_dead_lettered", pool=pool, request_id=request.request_id, reason=reason, deliveries=deliveries)


    async def begin(self, caller_id: str, attempt: Attempt, first: bool) -> bool:
        record = json.dumps(dataclasses.asdict(attempt))
        with unreachable():
            (done,) = await self._records.call(
                self._begin,
                keys=[self.keys.attempts(caller_id), self.keys.called_off(caller_id)],
                args=[record, "1" if first else "0", self._s.event_idle_ttl_s],
            )
        return int(done) == 1

    async def forget(self, caller_id: str) -> None:
        with unreachable():
            await self._r.delete(self.keys.attempts(caller_id))

    async def attempts(self, caller_id: str) -> list[Attempt]:
        with unreachable():
            raw: Any = await self._r.lrange(self.keys.attempts(caller_id), 0, -1)
        return [_attempt(json.loads(r)) for r in raw]

    async def attach(self, caller_id: str) -> int:
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.incr(self.keys.attaches(caller_id))
                pipe.expire(self.keys.attaches(caller_id), self._s.event_idle_ttl_s)
                n, _ = await pipe.execute()
        return int(n)

    async def attach_count(self, caller_id: str) -> int:
        with unreachable():
            n: Any = await self._r.get(self.keys.attaches(caller_id))
        return int(n or 0)

    async def end(self, request_id: str, event: JobEvent) -> None:
        key = self.keys.events(request_id)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.xadd(key, {EVENT_FIELD: codec.encode_event(event)})
                pipe.expire(key, self._s.event_ttl_s)
                await pipe.execute()

    async def read_events(self, request_id: str) -> list[tuple[str, JobEvent]]:
        with unreachable():
            raw: Any = await self._r.xrange(self.keys.events(request_id))
        return [(i.decode(), codec.decode_event(f[EVENT_FIELD.encode()])) for i, f in raw]

    async def set_aside(self, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                self._dead_record(pipe, pool, request, reason, deliveries)
                await pipe.execute()
        log.error("job_dead_lettered", pool=pool, request_id=request.request_id, reason=reason, deliveries=deliveries)

    def _dead_record(self, pipe: Any, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        fields = {JOB_FIELD: codec.encode_job(request), "reason": reason, "deliveries": deliveries}
        most = self._s.dead_letter_maxlen or None
        pipe.xadd(self.keys.dead_letters(pool), fields, maxlen=most, approximate=True)

    async def _drop(self, stream: str, entry_ids: list[str]) -> None:
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.xack(stream, WORKER_GROUP, *entry_ids)
                pipe.xdel(stream, *entry_ids)
                await pipe.execute()

    async def adapters(self, pool: str) -> dict[str, str]:
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.adapters(pool))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def set_adapter(self, pool: str, name: str, path: str) -> None:
        with unreachable():
            await self._r.hset(self.keys.adapters(pool), name, path)

    async def drop_adapter(self, pool: str, name: str) -> None:
        with unreachable():
            await self._r.hdel(self.keys.adapters(pool), name)

    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> None:
        """Affinity on, in the same round trip: a ready worker renews and rebalances its partitions
        (``affinity.OWN``, for ``ttl_s``), any other gives them up; off: the pool must have no
        partitions recorded. Either way a mismatch raises QueueMisconfigured."""
        pool = status.pool
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                key = self.keys.worker(pool, status.worker)
                pipe.set(key, codec.encode_status(status), px=int(ttl_s * 1000))
                pipe.sadd(self.keys.workers(pool), status.worker)
                by_stream: dict[tuple[str, int | None], list[Any]] = {}
                for ref in touch:  # the jobs it runs, in the same round trip
                    tenant, k, eid = split_ref(ref)
                    by_stream.setdefault((tenant, k), []).append(eid)
                for (tenant, k), eids in by_stream.items():
                    pipe.xclaim(self.keys.work(pool, tenant, k), WORKER_GROUP, status.worker, 0, eids, justid=True)
                own_keys = [self.keys.owners(pool), self.keys.partitions(pool)]
                own_args: list[Any] = [status.worker, int(ttl_s * 1000), self._parts,
                                       "own" if status.ready else "leave"]
                if not self._parts:
                    pipe.exists(self.keys.partitions(pool))
                elif not self._cluster:
                    await self._own(keys=own_keys, args=own_args, client=pipe)
                replies = await pipe.execute(raise_on_error=False)
            if self._parts and self._cluster:  # a cluster pipeline refuses scripts: its own call
                try:
                    replies.append(await self._own(keys=own_keys, args=own_args))
                except ResponseError as exc:
                    replies.append(exc)
            for reply in replies[:-1]:  # a stream gone (its jobs with it) has nothing to touch
                if isinstance(reply, BaseException) and not _gone(reply):
                    raise reply
        last = replies[-1]
        if isinstance(last, BaseException):
            raise QueueUnavailable(f"cannot record the worker's partitions: {last}") from last
        if self._parts and int(last[0]) == 0:
            self._owned[(pool, status.worker)] = sorted(int(k) for k in last[1:])
        elif self._parts or int(last):
            self._owned.pop((pool, status.worker), None)
            await self._misconfigured(pool)

    def owned(self, pool: str, worker: str) -> list[int]:
        """The partitions the worker owned at its last heartbeat through this queue (affinity on)."""
        return list(self._owned.get((pool, worker), ()))

    async def leave(self, pool: str, worker: str) -> None:
        """Also gives up the worker's partitions (affinity on): the others take them at once."""
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.worker(pool, worker))
                pipe.srem(self.keys.workers(pool), worker)
                await pipe.execute()
            if self._parts:
                await self._own(keys=[self.keys.owners(pool), self.keys.partitions(pool)],
                                args=[worker, 0, self._parts, "leave"])  # fmt: skip
        self._owned.pop((pool, worker), None)

    def _ttls(self, events: Sequence[tuple[Lease, JobEvent]], now: float) -> tuple[list[tuple[int, bool]], set[str]]:
        """Per event: the TTL its stream gets now (0: none) and whether its caller's attempts record
        is renewed with it; and the requests whose idle TTL this renews. A terminal event gives its
        stream the ended TTL; the first event of a request creates its stream and bounds its life in
        case no terminal follows, and later ones push that bound on at most every quarter of it."""
        renewed: set[str] = set()
        out: list[tuple[int, bool]] = []
        for lease, event in events:
            rid = lease.request.request_id
            if event.terminal:
                out.append((self._s.event_ttl_s, False))
            elif rid not in renewed and now >= self._renew_at.get(rid, now):
                out.append((self._s.event_idle_ttl_s, rid in self._renew_at))  # a renewal: the record too
                renewed.add(rid)
            else:
                out.append((0, False))
        return out, renewed

    def _ack(self, pipe: Any, lease: Lease) -> None:
        stream = self.keys.work(lease.pool, lease.tenant, lease.partition)
        pipe.xack(stream, WORKER_GROUP, lease.entry_id)
        pipe.xdel(stream, lease.entry_id)

    async def publish(
        self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]
    ) -> set[str]:
        """Also (re)sets a stream's idle TTL (``_ttls``), so that a long request keeps its stream while
        it runs; renewals count only once the pipeline went through. A single server gets one script
        for all the step's events (_publish_one_script); a cluster one command per event (this)."""
        if not self._cluster:
            return await self._publish_one_script(events, watch)
        now = self._clock()
        ttls, renewed = self._ttls(events, now)
        # On a cluster (its pipelines refuse scripts) the attempts' scripts run after the pipeline.
        ended: list[tuple[Any, list[str], list[Any]]] = []
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                for (lease, event), (ttl, record) in zip(events, ttls, strict=True):
                    req = lease.request
                    key = self.keys.events(req.request_id)
                    pipe.xadd(key, {EVENT_FIELD: codec.encode_event(event)})
                    if ttl:
                        pipe.expire(key, ttl)
                    if record:
                        pipe.expire(self.keys.attempts(req.caller_id), self._s.event_idle_ttl_s)
                    if event.terminal:
                        ended.append((self._ended, [self.keys.attempts(req.caller_id)], [req.request_id, ttl]))
                        self._ack(pipe, lease)
                n_flags = self._check_cancelled(pipe, watch)
                replies = await pipe.execute()
            await call_scripts(self._r, ended)
        self._renewed(now, renewed, [lease.request.request_id for lease, event in events if event.terminal])
        return self._cancelled(watch, replies[len(replies) - n_flags :])

    async def _publish_one_script(
        self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]
    ) -> set[str]:
        """``publish`` on a single server: every event's XADD and TTLs in one _APPEND, then the
        terminal events' acks and the renewals of callers' records, then the cancel flags."""
        now = self._clock()
        ttls, renewed = self._ttls(events, now)
        keys: list[str] = []
        args: list[Any] = [EVENT_FIELD]
        ended: list[Lease] = []  # acked after the script wrote their terminal events
        records: list[str] = []  # callers' attempts records whose TTL is renewed
        for (lease, event), (ttl, record) in zip(events, ttls, strict=True):
            req = lease.request
            keys.append(self.keys.events(req.request_id))
            args += [codec.encode_event(event), ttl, req.request_id if event.terminal else ""]
            if event.terminal:
                keys.append(self.keys.attempts(req.caller_id))
                ended.append(lease)
            if record:
                records.append(self.keys.attempts(req.caller_id))
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                if keys:
                    pipe.eval(_APPEND, len(keys), *keys, *args)
                for lease in ended:
                    self._ack(pipe, lease)
                for attempts in records:
                    pipe.expire(attempts, self._s.event_idle_ttl_s)
                n_flags = self._check_cancelled(pipe, watch)
                replies = await pipe.execute() if len(pipe) else []
        self._renewed(now, renewed, [lease.request.request_id for lease in ended])
        return self._cancelled(watch, replies[len(replies) - n_flags :])

    def _renewed(self, now: float, renewed: set[str], ended: Sequence[str]) -> None:
        """Note the streams whose idle TTL was just renewed and forget the requests that ended. An
        entry overdue by a whole TTL belongs to a job this process gave up without a terminal
        event (its stream expired): those go too, looked for every quarter TTL."""
        ttl = self._s.event_idle_ttl_s
        for rid in renewed:
            self._renew_at[rid] = now + ttl * RENEW_FRACTION
        for rid in ended:
            self._renew_at.pop(rid, None)
        if now >= self._forget_at:
            self._renew_at = {rid: at for rid, at in self._renew_at.items() if at + ttl > now}
            self._forget_at = now + ttl * RENEW_FRACTION


def _attempt(record: dict[str, Any]) -> Attempt:
    """An attempts record as stored (JSON: its tuples are lists)."""
    for name in ("bases", "ended"):
        if name in record:
            record[name] = tuple(record[name])
    return Attempt(**record)
