"""A batch's items in their pool's lanes (lanes.py): leased by the pool's workers, earliest
deadline first, reclaimed from dead ones, and ended with one result each (run at least once,
recorded exactly once), or without running when they can no longer start; a batch's lanes are
deleted once none of its items waits for a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import batch_record, codec, groups
from llamamesh.queue.keys import JOB_FIELD, PREFIX_HOLD_MS, Keys, Retention
from llamamesh.queue.lanes import BatchLanes, Entry
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.scripts import register
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus

# How often a lease asked to wait (``block_ms``) looks at the lanes again.
POLL_S = 0.05


class BatchItems:
    """The items' side of a batch: workers read the lanes (lanes.py) through the same consumer
    group name as the interactive streams. Redis errors become QueueUnavailable."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retention: Retention,
        fail_after: int,
        claim_idle_s: float,
        hold_ms: int = PREFIX_HOLD_MS,
        replicas: Replicas | None = None,
    ) -> None:
        """``replicas``: how many Redis replicas hold an item's result before its ack is sent."""
        self._r = client
        self.replicas = replicas or Replicas()
        self.keys = keys
        self.retention = retention
        self.fail_after = fail_after
        self.claim_idle_s = claim_idle_s
        self.lanes = BatchLanes(client, keys, hold_ms)
        self._record = register(client, "record_result")
        self._skip = register(client, "skip_unstarted")
        self._start = register(client, "start_items")

    async def join(self, pool: str) -> None:
        """Nothing to make: a lane gets its consumer group with its first lease."""

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        """Take up to ``count`` new batch items, earliest deadline first (``BatchLanes.lease``). The
        lanes are read without blocking: with ``block_ms``, a call that finds none looks again every
        ``POLL_S`` for that long. An item of a cancelled batch comes with ``cancelled``, one past its
        batch's deadline with ``expired``: the worker records those without running them."""
        until = time.monotonic() + (block_ms or 0) / 1000
        while True:
            entries = await self.lanes.lease(pool, consumer, count)
            if entries or time.monotonic() + POLL_S > until:
                return await self._leases(pool, entries)
            await asyncio.sleep(POLL_S)

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        """Take over items another worker leased and has not touched for ``min_idle_ms`` (it died),
        from any of the pool's lanes (``BatchLanes.reclaim``)."""
        return await self._leases(pool, await self.lanes.reclaim(pool, consumer, min_idle_ms, count))

    async def touch(self, pool: str, consumer: str, refs: Sequence[str]) -> list[str]:
        """Reset the idle time of items this worker is still running (``Lease.item_ref`` each), so
        nobody reclaims them; returns those another worker took over meanwhile."""
        return await self.lanes.touch(pool, consumer, refs)

    async def _leases(self, pool: str, entries: Sequence[Entry]) -> list[Lease]:
        """Leases of the entries read, each batch's items marked started in one script a batch
        (start_items.lua), which says whether they may run; an entry that is no job is dropped."""
        decoded: list[tuple[str, str, GenerationRequest]] = []
        bad: dict[str, list[str]] = {}
        for lane, eid, fields in entries:
            try:
                decoded.append((lane, eid, codec.decode_job(fields[JOB_FIELD.encode()])))
            except (InvalidRequest, KeyError):
                bad.setdefault(self.lanes.stream(pool, lane), []).append(eid)
        by_batch: dict[str, list[str]] = {}
        for _lane, _eid, req in decoded:
            by_batch.setdefault(req.batch_id, []).append(req.custom_id)
        now = time.time()
        with unreachable():
            replies = await call_scripts(
                self._r,
                [
                    (self._start, [self.keys.batch(bid), self.keys.batch_started(bid)], [now, *cids])
                    for bid, cids in by_batch.items()
                ],
            )
        for stream, eids in bad.items():
            await groups.drop(self._r, stream, eids)
        gate = {bid: r.decode() if isinstance(r, bytes) else str(r) for bid, r in zip(by_batch, replies, strict=False)}
        return [
            Lease(
                pool,
                eid,
                req,
                cancelled=gate[req.batch_id] not in ("ok", "expired"),
                expired=gate[req.batch_id] == "expired",
                shared=not lane,
            )
            for lane, eid, req in decoded
        ]

    async def discard(self, lease: Lease) -> int:
        """Ack and drop a leased item without a result (a second copy of an item already running), or
        after its result. Returns how many entries its lane still holds (one round trip)."""
        stream = self.lanes.stream(lease.pool, "" if lease.shared else lease.request.batch_id)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                groups.ack(pipe, stream, lease.entry_id)
                pipe.xlen(stream)
                replies = await pipe.execute()
        return int(replies[-1])

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        """Record the item's one result (False: it had one already, or its batch is gone), then ack
        it. The result that fails the batch (its first ``fail_after`` all errored) settles it.

        One script (record_result.lua) writes the result only if the item has none yet
        (``Keys.batch_done``, custom_id -> status), appends it to ``Keys.batch_results``, counts it
        and, with the last item, ends the batch. A worker that dies leaves its items pending for
        another to claim (:meth:`reclaim`), and a second result for the same custom_id is dropped
        here: execution is at least once, the result exactly once.

        With ``replicas``, the ack waits until that many replicas hold the result (WAIT), else
        raises QueueUnavailable leaving the item leased: the result and its ack may reach different
        primaries across a failover (the old one takes writes until it is demoted), and an ack
        that outlived its result would leave an item that never ends."""
        req = lease.request
        done = await self.write(req.batch_id, result)
        left = await self.discard(lease)
        if done == 1 and not lease.shared and not left:
            # its lane is empty, the batch not ended: a result may have been lost (BatchSweep.end_lost)
            await self.look_again_soon(req.batch_id)
        elif done == 2:
            await self.settle(req.batch_id)
            await self.look_again_soon(req.batch_id)
        elif done == 3:
            await self.lanes.close_ended(await batch_record.read(self._r, self.keys, req.batch_id))
            # Ended: no sweep needs to look at it again (else the sweep drops it at its deadline).
            with contextlib.suppress(QueueUnavailable), unreachable():
                await self._r.zrem(self.keys.batches_open(), req.batch_id)
        return done >= 1

    async def write(self, batch_id: str, result: ItemResult) -> int:
        """Write an item's result unless it has one (record_result.lua's reply), on ``replicas``."""
        usage = result.usage
        args = [result.custom_id, result.status.value, codec.encode_result(result), time.time(), self.retention.batch_s]
        args += [self.fail_after, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens]
        with unreachable():
            keys = batch_record.item_keys(self.keys, batch_id)
            replies = await self.replicas.script(self._r, self._record, keys, args)
        return int(self.replicas.check(replies, "the item's result")[0])

    async def settle(self, batch_id: str) -> BatchInfo | None:
        """End, without running them, the items that can no longer start: all unstarted ones of a
        cancelling or failed batch, or of one past its deadline (those end expired), through
        skip_unstarted.lua. Safe to repeat and to run from several processes at once. Returns the
        batch after it (None: unknown)."""
        info = await batch_record.read(self._r, self.keys, batch_id)
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
        keys = batch_record.item_keys(self.keys, batch_id)
        with unreachable():
            cursor: Any = 0
            while True:
                reply: Any = await self._r.sscan(keys[3], cursor, count=500)
                cursor, ids = reply
                args: list[Any] = [time.time(), self.retention.batch_s, status.value]
                for raw in ids:
                    cid = raw.decode()
                    args += [cid, codec.encode_result(ItemResult.unrun(cid, status, why))]
                if ids and int(await self._skip(keys=keys, args=args)) < 0:
                    break
                if int(cursor) == 0:
                    break
        after = await batch_record.read(self._r, self.keys, batch_id)
        await self.lanes.close_ended(after)
        return after

    async def look_again_soon(self, batch_id: str) -> None:
        """A batch that now waits only for its running items: the sweep looks at it once a dead
        worker's items could be claimed, not at its (maybe distant) deadline."""
        if self.claim_idle_s > 0:
            with unreachable():
                await self._r.zadd(self.keys.batches_open(), {batch_id: time.time() + self.claim_idle_s}, lt=True)
