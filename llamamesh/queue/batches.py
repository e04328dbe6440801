"""Durable batches on Redis: ``RedisBatches``, the batch store's both faces, composed of one part per
role: intake.py (a batch's creation, whole or not at all), batch_record.py (its record, and each
owner's list of batches), batch_items.py (its items, leased by workers and ended with one result
each), batch_sweep.py (the gateways' sweep of what can no longer run and of what expired). Here:
the gateway's reads, its cancel, and its wait for results.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import batch_record, codec
from llamamesh.queue.batch_items import BatchItems
from llamamesh.queue.batch_record import COUNTS, info_of
from llamamesh.queue.batch_sweep import SWEEPER, BatchSweep
from llamamesh.queue.follow import EventFollower, Item
from llamamesh.queue.intake import BatchIntake
from llamamesh.queue.keys import PREFIX_HOLD_MS, RESULT_FIELD, Keys, Retention
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import UNREACHABLE, unreachable
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.scripts import register
from llamamesh.settings import BatchSettings
from llamamesh.types import BatchInfo, GenerationRequest, ItemResult

# Also importable from here, where callers outside the store's roles look for them.
__all__ = ["COUNTS", "SWEEPER", "RedisBatches", "info_of"]

# At most this many results per ``results`` call.
PAGE = 500
# A stream entry id as XREAD takes it ("<ms>-<seq>" or "<ms>"), each part below 2**64.
STREAM_ID = re.compile(r"^(\d{1,20})(?:-(\d{1,20}))?$")


# Batches read past a page's size, so that a page with unsealed ones among its batches still fills in one read.
UNSEALED_SLACK = 4


class RedisBatches:
    """The batch store, both faces: the gateway's (create, get, owned, cancel, results, the sweep)
    and the worker's (lease_items, record, touch, reclaim). Redis errors become QueueUnavailable.

    With ``replicas`` (``RedisSettings.wait_replicas``) a batch's creation and its cancel are on that
    many replicas before the caller is answered (WAIT), and an item's result before its ack is sent
    (BatchItems.record)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retention_s: int,
        fail_after: int = 0,
        claim_idle_s: float = 0.0,
        follow_block_ms: int = 2000,
        replicas: Replicas | None = None,
        prefix_hold_ms: int = PREFIX_HOLD_MS,
        outage_grace_s: float = 0.0,
    ) -> None:
        self._r = client
        self.keys = keys
        self._replicas = replicas or Replicas()
        self.retention = Retention(batch_s=retention_s)
        self.intake = BatchIntake(client, keys, self.retention, self._replicas)
        # claim_idle_s, the sweep's: items leased this long without a touch belong to a dead worker
        # (0: never ended by the sweep; workers' own reclaim still takes them over).
        # prefix_hold_ms: how long the rest of a prefix group waits for the worker that leased its
        # first item (lanes.py).
        self._items = BatchItems(client, keys, self.retention, fail_after, claim_idle_s, prefix_hold_ms, self._replicas)
        self._sweep = BatchSweep(client, keys, self.retention, self._items, self.intake)
        self._cancel = register(client, "cancel_batch")
        # Made by the first waiting ``results``; every caller waiting on any batch shares its one
        # blocking XREAD, which blocks this long at a time.
        self._follow_block_ms = follow_block_ms
        # How long a Redis outage may last before the waiting callers hear of it (they wait meanwhile).
        self._outage_grace_s = outage_grace_s
        self._follower: EventFollower | None = None

    @classmethod
    def from_settings(
        cls,
        client: aioredis.Redis,
        keys: Keys,
        settings: BatchSettings,
        replicas: Replicas | None = None,
        outage_grace_s: float = 0.0,
    ) -> RedisBatches:
        return cls(
            client,
            keys,
            settings.retention_s,
            settings.fail_after,
            claim_idle_s=settings.claim_idle_s,
            replicas=replicas,
            outage_grace_s=outage_grace_s,
        )

    # ---- the gateway's side --------------------------------------------------
    async def create(
        self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]
    ) -> tuple[BatchInfo, bool]:
        """Store the batch whole and queue its items (``(pool, request)`` each), or raise having
        stored nothing (llamamesh/queue/intake.py); returns it and whether it is new. The same
        batch_id again with the same fingerprint returns the stored batch (queueing what a failed
        submission left out); with another fingerprint, AlreadyExists."""
        created = await self.intake.create(info, fingerprint, items)
        got = await self.get(info.batch_id)
        if got is None:
            raise QueueUnavailable(f"batch {info.batch_id!r} vanished while being written")
        return got, created

    async def get(self, batch_id: str) -> BatchInfo | None:
        """The batch if it was accepted (sealed: stored whole, every item queued); None when unknown, purged, or
        its submission did not complete (unsealed: for a retry to finish, or the sweep to drop)."""
        info, sealed = await self._read(batch_id)
        return info if sealed else None

    async def stored(self, batch_id: str) -> bool:
        info, _sealed = await self._read(batch_id)
        return info is not None

    async def _read(self, batch_id: str) -> tuple[BatchInfo | None, bool]:
        """The batch's record (None: unknown, or purged) and whether it is sealed."""
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.batch(batch_id))
        info = batch_record.info_of(raw) if raw and b"state" in raw else None
        return info, info is not None and b"enqueued" in raw

    async def data_since(self) -> float:
        with unreachable():
            value: Any = await self._r.get(self.keys.epoch())
        _id, _, since = (value or b"").decode().partition("@")
        return float(since) if since.isdigit() else 0.0

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        """The owner's batches created before ``before`` (None: all), newest first, at most ``limit``."""
        key = self.keys.batches(owner)
        out: list[BatchInfo] = []
        top = f"({before}" if before is not None else "+inf"
        while len(out) < limit:
            want = limit - len(out) + UNSEALED_SLACK
            with unreachable():
                got: Any = await self._r.zrevrangebyscore(key, top, "-inf", start=0, num=want, withscores=True)
            for raw_id, score in got:
                info, sealed = await self._read(raw_id.decode())
                if info is None:  # purged after its retention
                    with unreachable():
                        await self._r.zrem(key, raw_id)
                elif sealed and len(out) < limit:  # (an unsealed one is not reported: a retry may still seal it)
                    out.append(info)
                top = f"({score}"  # the next read goes on below it, whatever was added or removed meanwhile
            if len(got) < want:
                break
        return out

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        """Move an unfinished batch to cancelling and end its unstarted items cancelled (running ones
        finish; the batch is cancelled with the last); an ended one is returned as it is. None if
        unknown."""
        with unreachable():
            replies = await self._replicas.script(
                self._r, self._cancel, keys=[self.keys.batch(batch_id)], args=[time.time()]
            )
        state = replies[0]
        if state:
            self._replicas.check(replies, "the cancel")
        if state == b"cancelling":
            await self._items.settle(batch_id)
            await self._items.look_again_soon(batch_id)
        return await self.get(batch_id) if state else None

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
            self._follower = EventFollower(
                self._r, self.keys, self._follow_block_ms, self.retention.event_idle_s, self._outage_grace_s
            )
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

    # ---- the sweep (batch_sweep.py) -----------------------------------------
    async def settle(self, batch_id: str) -> BatchInfo | None:
        return await self._items.settle(batch_id)

    async def sweep(self, limit: int = 100) -> int:
        return await self._sweep.sweep(limit)

    async def open_batches(self, limit: int = 1000) -> list[BatchInfo]:
        return await self._sweep.open_batches(limit)

    async def forget_purged(self, limit: int = 100) -> int:
        return await self._sweep.forget_purged(limit)

    async def end_abandoned(self, info: BatchInfo, page: int = 1000) -> BatchInfo | None:
        return await self._sweep.end_abandoned(info, page)

    # ---- the worker's side (batch_items.py) ----------------------------------
    async def join(self, pool: str) -> None:
        await self._items.join(pool)

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        return await self._items.lease_items(pool, consumer, count, block_ms)

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        return await self._items.reclaim(pool, consumer, min_idle_ms, count)

    async def touch(self, pool: str, consumer: str, refs: Sequence[str]) -> list[str]:
        return await self._items.touch(pool, consumer, refs)

    async def discard(self, lease: Lease) -> None:
        await self._items.discard(lease)

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        return await self._items.record(lease, result)


def _cursor(after: str) -> str:
    """``after`` if Redis takes it as a stream id; otherwise InvalidRequest on the cursor (checked
    here: one bad id in the follower's shared read would fail every caller waiting in it)."""
    m = STREAM_ID.match(after)
    if m is None or any(int(part) >= 2**64 for part in m.groups("0")):
        raise InvalidRequest.field("cursor", "not a BatchResult.cursor")
    return after


def _result(entry_id: str, fields: dict[bytes, bytes]) -> tuple[str, ItemResult]:
    return entry_id, codec.decode_result(fields[RESULT_FIELD.encode()])
