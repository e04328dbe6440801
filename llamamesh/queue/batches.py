"""Durable batches on Redis.

- A batch's record is a hash (``keys.batch``): state, owner, counts, the time it entered each
  state (``t:<state>``), its deadline; ``keys.batches(owner)`` lists an owner's batches.
- It is created whole or not at all (intake.py: a submission that fails half-way leaves nothing, or
  an unsealed batch its retry completes). Its items are jobs on the pool's *batch* work stream
  (``keys.batch_items``), a second stream the pool's workers read through the same consumer group
  name, below the interactive one.
- A result is recorded by one Lua script (``_RECORD``) that writes it only if the item has none
  yet (``keys.batch_done``, custom_id -> status), appends it to ``keys.batch_results``, counts it
  and, with the last item, ends the batch; then the item is acked. A worker that dies leaves its
  items pending: another worker claims them after ``claim_idle_ms`` (``reclaim``), and a second
  result for the same custom_id is dropped: execution is at least once, the result exactly once.
- The gateways' sweep ends what can no longer run even while no worker is alive: unstarted items of
  a batch past its deadline (expired) or cancelled/failed (cancelled), and items a dead worker left
  leased (untouched for ``claim_idle_s``), so every batch reaches an end state by itself.
- Counts never drift: ``processing`` is ``total`` minus the recorded ones.
- Nothing outlives its batch: the record and results expire ``retention_s`` after the end, and the
  sweep then takes the batch off its owner's list (``keys.batches_kept``), a bounded page per sweep.
- Waiting for results (``results`` with a block) goes through the store's one ``EventFollower``:
  every caller waiting on any batch shares its one blocking XREAD, so open StreamBatchResults
  streams hold no Redis connection each.
- With ``replicas`` (``RedisSettings.wait_replicas``), a batch's creation and its cancel are on
  that many replicas before the caller is answered (WAIT); a result needs no WAIT: its ack comes
  after it, so a failover that loses it loses the ack too and the item runs again (redisio.py says
  what a failover can lose, and what WAIT guarantees).

Redis errors become ``QueueUnavailable`` here.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import codec
from llamamesh.queue.follow import EventFollower, Item
from llamamesh.queue.intake import BatchIntake
from llamamesh.queue.keys import JOB_FIELD, RESULT_FIELD, WORKER_GROUP, Keys
from llamamesh.queue.protocol import Lease, batch_at_risk
from llamamesh.queue.redisio import UNREACHABLE, Replicas, call_scripts, unreachable
from llamamesh.queue.streams import create_group, touch_entries
from llamamesh.settings import BatchSettings
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus

COUNTS = ("succeeded", "errored", "cancelled", "expired")

# Shared by _RECORD and _SKIP (KEYS: meta, done, results, ids, started): once every item has a
# result, end the batch (in_progress -> completed or expired, cancelling -> cancelled; failed stays)
# and start its retention.
_FINISH = """
local function finish(now, retention)
  local f = redis.call('HMGET', KEYS[1], 'total', 'succeeded', 'errored', 'cancelled', 'expired', 'state')
  local n = (tonumber(f[2]) or 0) + (tonumber(f[3]) or 0) + (tonumber(f[4]) or 0) + (tonumber(f[5]) or 0)
  if n < tonumber(f[1]) then return end
  local final = nil
  if f[6] == 'in_progress' then
    final = 'completed'
    if (tonumber(f[5]) or 0) > 0 then final = 'expired' end
  elseif f[6] == 'cancelling' then final = 'cancelled'
  elseif f[6] ~= 'failed' then return end
  if final then
    redis.call('HSET', KEYS[1], 't:finalizing', now, 'state', final, 't:' .. final, now)
  end
  redis.call('HSET', KEYS[1], 'results_expire_at', tonumber(now) + tonumber(retention))
  for i = 1, 5 do redis.call('EXPIRE', KEYS[i], retention) end
end
"""

# KEYS: meta, done, results, ids, started. ARGV: custom_id, status, encoded result, now, retention_s,
# fail_after. Returns 1 (recorded), 2 (recorded, and it failed the batch: its first fail_after
# results all errored), 0 (the item had a result already), -1 (no such batch: it was purged).
_RECORD = (
    _FINISH
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[3], '*', 'r', ARGV[3])
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
local ret = 1
if ARGV[2] == 'errored' and tonumber(ARGV[6]) > 0 then
  local f = redis.call('HMGET', KEYS[1], 'state', 'succeeded', 'errored')
  if f[1] == 'in_progress' and (tonumber(f[2]) or 0) == 0 and tonumber(f[3]) >= tonumber(ARGV[6]) then
    redis.call('HSET', KEYS[1], 'state', 'failed', 't:failed', ARGV[4])
    ret = 2
  end
end
finish(ARGV[4], ARGV[5])
return ret
"""
)

# Ends the items no worker has started, without running them. KEYS: meta, done, results, ids,
# started. ARGV: now, retention_s, status ('expired': only past the deadline, and from then on no
# item starts; 'cancelled': a cancelling or failed batch), then custom_id, encoded result, ...
# Returns how many it ended, -1 (no such batch), -2 (nothing to do in this state).
_SKIP = (
    _FINISH
    + """
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_at')
if not f[1] then return -1 end
if ARGV[3] == 'expired' then
  if f[1] ~= 'in_progress' or tonumber(ARGV[1]) <= tonumber(f[2]) then return -2 end
  redis.call('HSET', KEYS[1], 'closing', 'expired')
elseif f[1] ~= 'cancelling' and f[1] ~= 'failed' then return -2 end
local n = 0
for i = 4, #ARGV, 2 do
  if redis.call('SISMEMBER', KEYS[5], ARGV[i]) == 0 and redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[3]) == 1 then
    redis.call('XADD', KEYS[3], '*', 'r', ARGV[i + 1])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[1], ARGV[3], n) end
finish(ARGV[1], ARGV[2])
return n
"""
)

# Leased items about to run. KEYS: meta, started. ARGV: now, custom_id ... Returns 'ok' (they are
# marked started: no sweep ends them), 'expired' (past the deadline), or the state that stops them.
_START = """
local f = redis.call('HMGET', KEYS[1], 'state', 'expires_at', 'closing')
if not f[1] then return 'gone' end
if f[1] ~= 'in_progress' then return f[1] end
if f[3] or tonumber(ARGV[1]) > tonumber(f[2]) then return 'expired' end
for i = 2, #ARGV do redis.call('SADD', KEYS[2], ARGV[i]) end
return 'ok'
"""

# KEYS: meta. ARGV: now. Returns the state after the call ('' if there is no such batch). A batch
# cancelling already (a retry) gets its state written again: a WAIT after this call covers the
# first call's write.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return '' end
if state == 'in_progress' or state == 'validating' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 't:cancelling', ARGV[1])
  return 'cancelling'
end
if state == 'cancelling' then redis.call('HSET', KEYS[1], 'state', state) end
return state
"""


# The consumer name under which the sweep claims a dead worker's items before ending them.
SWEEPER = "batch-sweeper"
# At most this many results per ``results`` call.
PAGE = 500
# A stream entry id as XREAD takes it ("<ms>-<seq>" or "<ms>"), each part below 2**64.
STREAM_ID = re.compile(r"^(\d{1,20})(?:-(\d{1,20}))?$")


def _cursor(after: str) -> str:
    """``after`` if Redis takes it as a stream id; otherwise InvalidRequest on the cursor (checked
    here: one bad id in the follower's shared read would fail every caller waiting in it)."""
    m = STREAM_ID.match(after)
    if m is None or any(int(part) >= 2**64 for part in m.groups("0")):
        raise InvalidRequest.field("cursor", "not a BatchResult.cursor")
    return after


def _waits(info: BatchInfo) -> bool:
    """Whether the batch still waits for items (a failed batch waits for the ones that ran on)."""
    return not info.state.ended or (info.state is BatchState.FAILED and info.processing > 0)


def _float(raw: Any, default: float = 0.0) -> float:
    return float(raw) if raw is not None else default


def _result(entry_id: str, fields: dict[bytes, bytes]) -> tuple[str, ItemResult]:
    return entry_id, codec.decode_result(fields[RESULT_FIELD.encode()])


def info_of(raw: dict[bytes, bytes]) -> BatchInfo:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return BatchInfo(
        batch_id=f["id"],
        state=BatchState(f["state"]),
        owner=f.get("owner", ""),
        model=f.get("model", ""),
        total=int(f["total"]),
        completion_window_s=int(f.get("completion_window_s", "0")),
        created_at=_float(f.get("created_at")),
        expires_at=_float(f.get("expires_at")),
        **{c: int(f.get(c, "0")) for c in COUNTS},  # type: ignore[arg-type]
        times=MappingProxyType({k[2:]: float(v) for k, v in f.items() if k.startswith("t:")}),
        results_expire_at=_float(f.get("results_expire_at")),
        metadata=MappingProxyType(json.loads(f.get("metadata", "{}"))),
    )


class RedisBatches:
    """The batch store, both faces: the gateway's (create, get, owned, cancel, results) and the
    worker's (lease_items, record, touch, reclaim)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retention_s: int,
        fail_after: int = 0,
        claim_idle_s: float = 0.0,
        follow_block_ms: int = 2000,
        replicas: Replicas | None = None,
    ) -> None:
        self._r = client
        self.keys = keys
        self._replicas = replicas or Replicas()
        self.retention_s = retention_s
        self.fail_after = fail_after
        # The sweep's: items leased this long without a touch belong to a dead worker (0: never
        # ended by the sweep; workers' own reclaim still takes them over).
        self.claim_idle_s = claim_idle_s
        self._record = client.register_script(_RECORD)
        self._cancel = client.register_script(_CANCEL)
        self.intake = BatchIntake(client, keys, retention_s, self._replicas)
        self._skip = client.register_script(_SKIP)
        self._start = client.register_script(_START)
        # Where the next reclaim of each batch stream goes on scanning its pending entries.
        self._claim_from: dict[str, bytes | str] = {}
        # Made by the first waiting ``results``; its shared XREAD blocks this long at a time.
        self._follow_block_ms = follow_block_ms
        self._follower: EventFollower | None = None

    @classmethod
    def from_settings(
        cls, client: aioredis.Redis, keys: Keys, settings: BatchSettings, replicas: Replicas | None = None
    ) -> RedisBatches:
        return cls(client, keys, settings.retention_s, settings.fail_after, claim_idle_s=settings.claim_idle_s,
                   replicas=replicas)  # fmt: skip

    def _item_keys(self, batch_id: str) -> list[str]:
        k = self.keys
        return [k.batch(batch_id), k.batch_done(batch_id), k.batch_results(batch_id),
                k.batch_ids(batch_id), k.batch_started(batch_id)]  # fmt: skip

    # ---- gateway side -------------------------------------------------------
    async def create(
        self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]
    ) -> tuple[BatchInfo, bool]:
        """Store the batch whole and queue its items (``(pool, request)`` each), or raise having
        stored nothing (llamamesh/queue/intake.py); returns it and whether it is new. The same
        batch_id again with the same fingerprint returns the stored batch (queueing what a failed
        submission left out); with another fingerprint, AlreadyExists."""
        created = await self.intake.create(info, fingerprint, items)
        return await self._require(info.batch_id), created

    async def _require(self, batch_id: str) -> BatchInfo:
        got = await self.get(batch_id)
        if got is None:
            raise QueueUnavailable(f"batch {batch_id!r} vanished while being written")
        return got

    async def get(self, batch_id: str) -> BatchInfo | None:
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.batch(batch_id))
        return info_of(raw) if raw and b"state" in raw else None

    async def data_since(self) -> float:
        with unreachable():
            value: Any = await self._r.get(self.keys.epoch())
        _id, _, since = (value or b"").decode().partition("@")
        return float(since) if since.isdigit() else 0.0

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        """The owner's batches created before ``before`` (None: all), newest first, at most ``limit``."""
        key = self.keys.batches(owner)
        with unreachable():
            ids: Any = await self._r.zrevrangebyscore(
                key, f"({before}" if before is not None else "+inf", "-inf", start=0, num=limit
            )
            out = []
            for raw_id in ids:
                info = await self.get(raw_id.decode())
                if info is None:  # purged after its retention
                    await self._r.zrem(key, raw_id)
                else:
                    out.append(info)
        return out

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        """Move an unfinished batch to cancelling and end its unstarted items cancelled (running ones
        finish; the batch is cancelled with the last); an ended one is returned as it is. None if
        unknown."""
        with unreachable():
            replies = await self._replicas.script(self._r, self._cancel, keys=[self.keys.batch(batch_id)],
                                                  args=[time.time()])  # fmt: skip
        state = replies[0]
        if state:
            self._replicas.check(replies, "the cancel")
        if state == b"cancelling":
            await self.settle(batch_id)
            await self._look_again_soon(batch_id)
        return await self.get(batch_id) if state else None

    async def _look_again_soon(self, batch_id: str) -> None:
        """A batch that now waits only for its running items: the sweep looks at it once a dead
        worker's items could be claimed, not at its (maybe distant) deadline."""
        if self.claim_idle_s > 0:
            with unreachable():
                await self._r.zadd(self.keys.batches_open(), {batch_id: time.time() + self.claim_idle_s}, lt=True)

    async def settle(self, batch_id: str) -> BatchInfo | None:
        """End, without running them, the items that can no longer start: all unstarted ones of a
        cancelling or failed batch, or of one past its deadline (those end expired). Safe to repeat
        and to run from several processes at once. Returns the batch after it (None: unknown)."""
        info = await self.get(batch_id)
        if info is None or (info.state.ended and info.state is not BatchState.FAILED):
            return info
        if info.state is BatchState.IN_PROGRESS:
            if time.time() <= info.expires_at:
                return info
            status, why = ItemStatus.EXPIRED, "the batch's completion window ended before this item started"
        elif info.state is BatchState.FAILED:
            status, why = ItemStatus.CANCELLED, "the batch failed before this item started"
        else:
            status, why = ItemStatus.CANCELLED, "the batch was cancelled before this item started"
        keys = self._item_keys(batch_id)
        with unreachable():
            cursor: Any = 0
            while True:
                reply: Any = await self._r.sscan(keys[3], cursor, count=500)
                cursor, ids = reply
                args: list[Any] = [time.time(), self.retention_s, status.value]
                for raw in ids:
                    cid = raw.decode()
                    args += [cid, codec.encode_result(ItemResult.unrun(cid, status, why))]
                if ids and int(await self._skip(keys=keys, args=args)) < 0:
                    break
                if int(cursor) == 0:
                    break
        return await self.get(batch_id)

    async def sweep(self, limit: int = 100) -> int:
        """Settle the open batches whose deadline has passed, or that were cancelled (a gateway runs
        this periodically); returns how many it looked at. Items a dead worker left leased end
        too (``end_abandoned``). An ended batch leaves the open set; one still waiting for running
        items is looked at again after ``claim_idle_s`` (a minute if 0). Up to ``limit`` batches
        purged after their retention leave their owners' lists (``forget_purged``), and batches whose
        submission failed half-way and was not retried are dropped (``BatchIntake.drop_unsealed``)."""
        await self.intake.drop_unsealed(limit)
        key = self.keys.batches_open()
        with unreachable():
            due: Any = await self._r.zrangebyscore(key, "-inf", time.time(), start=0, num=limit)
            for raw in due:
                info = await self.settle(raw.decode())
                if info is not None and _waits(info):
                    info = await self.end_abandoned(info)
                if info is None or not _waits(info):
                    await self._r.zrem(key, raw)
                else:
                    await self._r.zadd(key, {raw: time.time() + (self.claim_idle_s or 60)})
        await self.forget_purged(limit)
        return len(due)

    async def at_risk(self, fraction: float, limit: int = 1000) -> int:
        with unreachable():
            ids: Any = await self._r.zrange(self.keys.batches_open(), 0, limit - 1)
            if not ids:
                return 0
            async with self._r.pipeline(transaction=False) as pipe:
                for raw_id in ids:
                    pipe.hgetall(self.keys.batch(raw_id.decode()))
                found: Any = await pipe.execute()
        now = time.time()
        return sum(1 for raw in found if raw and b"state" in raw and batch_at_risk(info_of(raw), now, fraction))

    async def forget_purged(self, limit: int = 100) -> int:
        """Take up to ``limit`` batches whose record expired (their retention ended) off their owners'
        lists; one still kept is looked at again when its retention ends. Returns how many went.
        Raises QueueUnavailable."""
        key = self.keys.batches_kept()
        now = time.time()
        with unreachable():
            due: Any = await self._r.zrangebyscore(key, "-inf", now, start=0, num=limit)
            if not due:
                return 0
            pairs = [json.loads(member) for member in due]
            async with self._r.pipeline(transaction=False) as pipe:
                for _owner, batch_id in pairs:
                    pipe.hmget(self.keys.batch(batch_id), "state", "results_expire_at")
                found: Any = await pipe.execute()
            gone = 0
            async with self._r.pipeline(transaction=False) as pipe:
                for member, (owner, batch_id), (state, until) in zip(due, pairs, found, strict=True):
                    if state is None:
                        pipe.zrem(self.keys.batches(owner), batch_id)
                        pipe.zrem(key, member)
                        gone += 1
                    else:  # still kept: ended (until its retention ends), or not yet (at least that long)
                        again = float(until) + 1 if until is not None else now + self.retention_s
                        pipe.zadd(key, {member: max(again, now + 1)})
                await pipe.execute()
        return gone

    async def end_abandoned(self, info: BatchInfo, page: int = 1000) -> BatchInfo | None:
        """End the items of this batch that a dead worker left leased (untouched for ``claim_idle_s``)
        once they can no longer run: past the deadline (expired), or the batch cancelled or failed
        (cancelled). The sweep claims each one first (XCLAIM with the same minimum idle time as the
        workers' reclaim), so a worker and the sweep never both take one; the result is recorded
        exactly once either way. Returns the batch after it."""
        if self.claim_idle_s <= 0:
            return info
        if info.state is BatchState.IN_PROGRESS:
            if time.time() <= info.expires_at:
                return info
            status, why = ItemStatus.EXPIRED, "the batch's completion window ended while this item's worker was gone"
        else:
            ended = "failed" if info.state is BatchState.FAILED else "was cancelled"
            status, why = ItemStatus.CANCELLED, f"the batch {ended} while this item's worker was gone"
        idle_ms = int(self.claim_idle_s * 1000)
        with unreachable():
            pools: Any = await self._r.hget(self.keys.batch(info.batch_id), "pools")
            for pool in filter(None, (pools or b"").decode().split(",")):
                stream = self.keys.batch_items(pool)
                for entry_id, req in await self._idle_items(stream, idle_ms, info.batch_id, page):
                    claimed: Any = await self._r.xclaim(stream, WORKER_GROUP, SWEEPER, idle_ms, [entry_id])
                    if claimed and claimed[0] and claimed[0][1]:  # still idle, still there: ours now
                        result = ItemResult.unrun(req.custom_id, status, why)
                        await self.record(Lease(pool, entry_id, req), result)
        return await self.get(info.batch_id)

    async def _idle_items(
        self, stream: str, idle_ms: int, batch_id: str, page: int
    ) -> list[tuple[str, GenerationRequest]]:
        """The leased entries of ``stream`` idle for ``idle_ms`` or more that are items of ``batch_id``."""
        out: list[tuple[str, GenerationRequest]] = []
        start = "-"
        while True:
            try:
                pending: Any = await self._r.xpending_range(stream, WORKER_GROUP, start, "+", page, idle=idle_ms)
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    return out
                raise
            if not pending:
                return out
            ids = [p["message_id"] for p in pending]
            async with self._r.pipeline(transaction=False) as pipe:
                for eid in ids:
                    pipe.xrange(stream, eid, eid)
                entries: Any = await pipe.execute()
            for eid, found in zip(ids, entries, strict=True):
                if not found:
                    continue
                try:
                    req = codec.decode_job(found[0][1][JOB_FIELD.encode()])
                except (InvalidRequest, KeyError):
                    continue  # a worker sets bad entries aside
                if req.batch_id == batch_id:
                    out.append((eid.decode(), req))
            if len(pending) < page:
                return out
            start = "(" + ids[-1].decode()

    async def results(self, batch_id: str, after: str, block_ms: int | None) -> list[tuple[str, ItemResult]]:
        """Results after cursor ``after`` ("0-0": from the first), at most ``PAGE``, waiting up to
        ``block_ms`` (0: without end; None: not at all) for one. A waiting call follows the results
        through the store's shared follower and unfollows when it returns or is cancelled. Raises
        InvalidRequest (a cursor that is no stream id), QueueUnavailable."""
        key = self.keys.batch_results(batch_id)
        _cursor(after)
        if block_ms is None:
            with unreachable():
                reply: Any = await self._r.xread({key: after}, count=PAGE)
            return [_result(eid.decode(), fields) for _stream, entries in reply or () for eid, fields in entries]
        if self._follower is None:
            self._follower = EventFollower(self._r, self.keys, self._follow_block_ms)
        follower = self._follower
        sub = await follower.follow(key, after)
        items: list[Item] = []
        try:
            try:
                items.append(await asyncio.wait_for(sub.queue.get(), block_ms / 1000 if block_ms > 0 else None))
            except asyncio.TimeoutError:
                return []
            while len(items) < PAGE and not sub.queue.empty():
                items.append(sub.queue.get_nowait())
        finally:
            follower.unfollow(sub)
        out: list[tuple[str, ItemResult]] = []
        for item in items:
            if isinstance(item, BaseException):
                if out:  # what came before the failure first; the next call follows anew
                    break
                raise QueueUnavailable(UNREACHABLE) from item
            out.append(_result(*item))
        return out

    async def close(self) -> None:
        """Stop the results follower (the client is the queue's: it closes it). Callers still
        waiting in ``results`` return empty at their block's end."""
        if self._follower is not None:
            await self._follower.close()
            self._follower = None

    # ---- worker side --------------------------------------------------------
    async def join(self, pool: str) -> None:
        await create_group(self._r, self.keys.batch_items(pool))

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        """Take up to ``count`` new batch items (waiting at most ``block_ms``; None: not at all). An
        item of a cancelled batch comes with ``cancelled``, one past its batch's deadline with
        ``expired``: the worker records those without running them."""
        with unreachable("cannot read the batch stream"):
            try:
                reply: Any = await self._r.xreadgroup(
                    WORKER_GROUP, consumer, {self.keys.batch_items(pool): ">"}, count=count, block=block_ms
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.join(pool)
                return []
        return await self._leases(pool, [e for _s, es in reply or () for e in es])

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        """Take over items another worker leased and has not touched for ``min_idle_ms`` (it died).

        XAUTOCLAIM looks at ``10 x count`` pending entries per call: each call goes on from where the
        last one stopped (back to the start once it reached the end), so an item a dead worker left
        behind many live workers' running ones is found within a few calls, not only at the batch's end."""
        stream = self.keys.batch_items(pool)
        with unreachable("cannot claim from the batch stream"):
            try:
                reply: Any = await self._r.xautoclaim(
                    stream, WORKER_GROUP, consumer, min_idle_ms, self._claim_from.get(stream, "0-0"), count=count
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                return []
        self._claim_from[stream] = reply[0]  # where the next call goes on ("0-0": back at the start)
        return await self._leases(pool, [e for e in reply[1] if e and e[1]])

    async def touch(self, pool: str, consumer: str, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of items this worker is still running, so nobody reclaims them."""
        await touch_entries(self._r, self.keys.batch_items(pool), consumer, entry_ids)

    async def _leases(self, pool: str, entries: list[Any]) -> list[Lease]:
        stream = self.keys.batch_items(pool)
        decoded: list[tuple[str, GenerationRequest]] = []
        bad: list[str] = []
        for entry_id, fields in entries:
            eid = entry_id.decode()
            try:
                decoded.append((eid, codec.decode_job(fields[JOB_FIELD.encode()])))
            except (InvalidRequest, KeyError):
                bad.append(eid)
        by_batch: dict[str, list[str]] = {}
        for _eid, req in decoded:
            by_batch.setdefault(req.batch_id, []).append(req.custom_id)
        now = time.time()
        with unreachable():
            replies = await call_scripts(self._r, [
                (self._start, [self.keys.batch(bid), self.keys.batch_started(bid)], [now, *cids])
                for bid, cids in by_batch.items()
            ])  # fmt: skip
            if bad:
                async with self._r.pipeline(transaction=False) as pipe:
                    pipe.xack(stream, WORKER_GROUP, *bad)
                    pipe.xdel(stream, *bad)
                    await pipe.execute()
        gate = {bid: r.decode() if isinstance(r, bytes) else str(r) for bid, r in zip(by_batch, replies, strict=False)}
        return [
            Lease(
                pool,
                eid,
                req,
                cancelled=gate[req.batch_id] not in ("ok", "expired"),
                expired=gate[req.batch_id] == "expired",
            )
            for eid, req in decoded
        ]

    async def discard(self, lease: Lease) -> None:
        """Ack and drop a leased item without a result (a second copy of an item already running)."""
        stream = self.keys.batch_items(lease.pool)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.xack(stream, WORKER_GROUP, lease.entry_id)
                pipe.xdel(stream, lease.entry_id)
                await pipe.execute()

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        """Record the item's one result (False: it had one already, or its batch is gone), then ack
        it. The result that fails the batch (its first ``fail_after`` all errored) settles it."""
        req = lease.request
        with unreachable():
            done = int(await self._record(
                keys=self._item_keys(req.batch_id),
                args=[req.custom_id, result.status.value, codec.encode_result(result), time.time(), self.retention_s,
                      self.fail_after],
            ))  # fmt: skip
        await self.discard(lease)
        if done == 2:
            await self.settle(req.batch_id)
            await self._look_again_soon(req.batch_id)
        return done >= 1
