"""A batch's items on their pool's batch work stream (``Keys.batch_items``): leased by the pool's
workers, reclaimed from dead ones, and ended with one result each (run at least once, recorded
exactly once), or without running when they can no longer start.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from llamamesh.errors import InvalidRequest
from llamamesh.queue import batch_record, codec, groups
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, Keys, Retention
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.queue.scripts import register
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus


class BatchItems:
    """The items' side of a batch: workers read the stream through the same consumer group name as
    the interactive one. Redis errors become QueueUnavailable."""

    def __init__(
        self, client: aioredis.Redis, keys: Keys, retention: Retention, fail_after: int, claim_idle_s: float
    ) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self.fail_after = fail_after
        self.claim_idle_s = claim_idle_s
        self._record = register(client, "record_result")
        self._skip = register(client, "skip_unstarted")
        self._start = register(client, "start_items")
        # Where the next reclaim of each batch stream goes on scanning its pending entries.
        self._claim_from: dict[str, bytes | str] = {}

    async def join(self, pool: str) -> None:
        await groups.create_group(self._r, self.keys.batch_items(pool))

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
        await groups.touch_entries(self._r, self.keys.batch_items(pool), consumer, entry_ids)

    async def _leases(self, pool: str, entries: list[Any]) -> list[Lease]:
        """Leases of the entries read, each batch's items marked started in one script a batch
        (start_items.lua), which says whether they may run; an entry that is no job is dropped."""
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
            replies = await call_scripts(
                self._r,
                [
                    (self._start, [self.keys.batch(bid), self.keys.batch_started(bid)], [now, *cids])
                    for bid, cids in by_batch.items()
                ],
            )
        if bad:
            await groups.drop(self._r, self.keys.batch_items(pool), bad)
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
        await groups.drop(self._r, self.keys.batch_items(lease.pool), [lease.entry_id])

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        """Record the item's one result (False: it had one already, or its batch is gone), then ack
        it. The result that fails the batch (its first ``fail_after`` all errored) settles it.

        One script (record_result.lua) writes the result only if the item has none yet
        (``Keys.batch_done``, custom_id -> status), appends it to ``Keys.batch_results``, counts it
        and, with the last item, ends the batch. A worker that dies leaves its items pending for
        another to claim (:meth:`reclaim`), and a second result for the same custom_id is dropped
        here: execution is at least once, the result exactly once."""
        req = lease.request
        with unreachable():
            done = int(
                await self._record(
                    keys=batch_record.item_keys(self.keys, req.batch_id),
                    args=[
                        req.custom_id,
                        result.status.value,
                        codec.encode_result(result),
                        time.time(),
                        self.retention.batch_s,
                        self.fail_after,
                        result.usage.prompt_tokens,
                        result.usage.completion_tokens,
                        result.usage.cached_tokens,
                    ],
                )
            )
        await self.discard(lease)
        if done == 2:
            await self.settle(req.batch_id)
            await self.look_again_soon(req.batch_id)
        return done >= 1

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
        return await batch_record.read(self._r, self.keys, batch_id)

    async def look_again_soon(self, batch_id: str) -> None:
        """A batch that now waits only for its running items: the sweep looks at it once a dead
        worker's items could be claimed, not at its (maybe distant) deadline."""
        if self.claim_idle_s > 0:
            with unreachable():
                await self._r.zadd(self.keys.batches_open(), {batch_id: time.time() + self.claim_idle_s}, lt=True)
