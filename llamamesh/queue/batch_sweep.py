"""The gateways' batch sweep: it ends what can no longer run even while no worker is alive, so every
batch reaches an end state by itself: unstarted items of a batch past its deadline (expired) or
cancelled or failed (cancelled), items a dead worker left leased (untouched for ``claim_idle_s``),
and items whose result a Redis failover lost (errored). Nothing outlives its batch: the record and
results expire ``Retention.batch_s`` after the end, and the sweep then takes the batch off its
owner's list (``Keys.batches_kept``), a bounded page per sweep.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import batch_record, codec
from llamamesh.queue.batch_items import BatchItems
from llamamesh.queue.intake import BatchIntake
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, Keys, Retention
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import unreachable
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus

log = structlog.get_logger(__name__)

# The consumer name under which the sweep claims a dead worker's items before ending them.
SWEEPER = "batch-sweeper"


class BatchSweep:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, retention: Retention, items: BatchItems, intake: BatchIntake
    ) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self._items = items
        self._intake = intake

    @property
    def claim_idle_s(self) -> float:
        """Items leased this long without a touch belong to a dead worker (0: never ended by the
        sweep; workers' own reclaim still takes them over)."""
        return self._items.claim_idle_s

    async def sweep(self, limit: int = 100) -> int:
        """Settle the open batches whose deadline has passed, or that were cancelled (a gateway runs
        this periodically); returns how many it looked at. Items a dead worker left leased end
        too (``end_abandoned``). An ended batch leaves the open set; one still waiting for running
        items is looked at again after ``claim_idle_s`` (a minute if 0). Up to ``limit`` batches
        purged after their retention leave their owners' lists (``forget_purged``), and batches whose
        submission failed half-way and was not retried are dropped (``BatchIntake.drop_unsealed``).
        Raises QueueUnavailable."""
        await self._intake.drop_unsealed(limit)
        key = self.keys.batches_open()
        with unreachable():
            due: Any = await self._r.zrangebyscore(key, "-inf", time.time(), start=0, num=limit)
            for raw in due:
                info = await self._items.settle(raw.decode())
                if info is not None and batch_record.waits(info):
                    info = await self.end_abandoned(info)
                if info is not None and batch_record.waits(info):
                    info = await self.end_lost(info)
                if info is None or not batch_record.waits(info):
                    await self._items.lanes.close_ended(info)
                    await self._r.zrem(key, raw)
                else:
                    await self._r.zadd(key, {raw: time.time() + (self.claim_idle_s or 60)})
        await self.forget_purged(limit)
        return len(due)

    async def open_batches(self, limit: int = 1000) -> list[BatchInfo]:
        with unreachable():
            ids: Any = await self._r.zrange(self.keys.batches_open(), 0, limit - 1)
            if not ids:
                return []
            async with self._r.pipeline(transaction=False) as pipe:
                for raw_id in ids:
                    pipe.hgetall(self.keys.batch(raw_id.decode()))
                found: Any = await pipe.execute()
        infos = (batch_record.info_of(raw) for raw in found if raw and b"state" in raw)
        return [info for info in infos if not info.state.ended]

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
                        again = float(until) + 1 if until is not None else now + self.retention.batch_s
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
            for pool in batch_record.pool_list(pools):
                for lane in (info.batch_id, ""):  # its lane, and the pool's shared stream
                    stream = self._items.lanes.stream(pool, lane)
                    for entry_id, req in await self._idle_items(stream, idle_ms, info.batch_id, page):
                        claimed: Any = await self._r.xclaim(stream, WORKER_GROUP, SWEEPER, idle_ms, [entry_id])
                        if claimed and claimed[0] and claimed[0][1]:  # still idle, still there: ours now
                            result = ItemResult.unrun(req.custom_id, status, why)
                            await self._items.record(Lease(pool, entry_id, req, shared=not lane), result)
        return await batch_record.read(self._r, self.keys, info.batch_id)

    async def end_lost(self, info: BatchInfo, page: int = 500) -> BatchInfo | None:
        """End, errored, the items of this sealed batch that can no longer get a result: none of its
        items is queued or leased in any of its pools, yet these have none. A worker writes an item's
        result before it acks the item, but across a Redis failover the two may reach different
        primaries (or the result only a primary that then crashed): the ack survives, the result
        does not. Returns the batch after it."""
        meta = self.keys.batch(info.batch_id)
        with unreachable():
            pools, sealed = await self._r.hmget(meta, "pools", "enqueued")
            if not sealed:
                return info
            for pool in batch_record.pool_list(pools):
                for lane in (info.batch_id, ""):  # its lane, and the pool's shared stream
                    if await self._r.xlen(self._items.lanes.stream(pool, lane)):
                        return info
            ids = [raw async for raw in self._r.sscan_iter(self.keys.batch_ids(info.batch_id), count=page)]
            lost: list[str] = []
            for i in range(0, len(ids), page):
                done: Any = await self._r.hmget(self.keys.batch_done(info.batch_id), ids[i : i + page])
                lost += [raw.decode() for raw, status in zip(ids[i : i + page], done, strict=True) if status is None]
        why = "its result was lost in a Redis failover after it ran; submit it again"
        for custom_id in lost:
            result = ItemResult(custom_id, ItemStatus.ERRORED, error_code=QueueUnavailable.code, error_message=why)
            await self._items.write(info.batch_id, result)
        if lost:
            log.warning("batch_results_lost", batch_id=info.batch_id, items=len(lost))
        return await batch_record.read(self._r, self.keys, info.batch_id)

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
