"""``MemoryBatches``: the batch store in one process, with the contract of ``batches.RedisBatches``
(no reclaim: nothing here dies separately). Items wait in each batch's lanes (``MemoryLanes``),
leased in the same order as on Redis."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from llamamesh.errors import AlreadyExists
from llamamesh.queue.affinity import grouped
from llamamesh.queue.keys import PREFIX_HOLD_MS
from llamamesh.queue.memory.lanes import MemoryLanes
from llamamesh.queue.protocol import Lease
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus, public_id


@dataclass
class _Batch:
    info: BatchInfo
    fingerprint: str
    done: dict[str, str] = field(default_factory=dict)
    results: list[tuple[str, ItemResult]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    started: set[str] = field(default_factory=set)
    closing: bool = False


class MemoryBatches:
    """BatchStore in one process, same contract as ``batches.RedisBatches`` (no reclaim: nothing
    here dies separately)."""

    def __init__(self, fail_after: int = 0, hold_ms: int = PREFIX_HOLD_MS) -> None:
        self.fail_after = fail_after
        self.since = time.time()
        self._batches: dict[str, _Batch] = {}
        self.lanes = MemoryLanes(hold_ms)
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        self._last_id = (0, 0)

    def _result_id(self) -> str:
        """A result's cursor as Redis makes a stream entry's id: ``<ms>-<seq>``, rising."""
        ms, seq = self._last_id
        now = int(time.time() * 1000)
        self._last_id = (now, 0) if now > ms else (ms, seq + 1)
        return "-".join(map(str, self._last_id))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, ready: Callable[[], bool], block_ms: int | None) -> None:
        if not ready() and block_ms:
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(ready), block_ms / 1000)

    async def create(
        self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]
    ) -> tuple[BatchInfo, bool]:
        have = self._batches.get(info.batch_id)
        if have is not None:
            if have.fingerprint != fingerprint:
                raise AlreadyExists(
                    f"batch id {public_id(info.batch_id)!r} names another batch (other items); "
                    "resubmit it unchanged, or use a new id"
                )
            return have.info, False
        now = time.time()
        times = {BatchState.VALIDATING.value: info.created_at, BatchState.IN_PROGRESS.value: now}
        stored = dataclasses.replace(info, state=BatchState.IN_PROGRESS, times=MappingProxyType(times))
        self._batches[info.batch_id] = _Batch(stored, fingerprint, ids=[req.custom_id for _p, req in items])
        for pool, req in grouped(items):
            self.lanes.queue(pool, stored, [(f"{next(self._ids)}-0", req)])
        await self._notify()
        return stored, True

    async def get(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        return b.info if b is not None else None

    async def stored(self, batch_id: str) -> bool:
        return batch_id in self._batches  # (created whole at once: never cut off)

    async def data_since(self) -> float:
        return self.since

    def lose_data(self) -> None:
        """Tests: what a Redis that came back empty looks like (every batch gone)."""
        self._batches.clear()
        self.since = time.time()

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        mine = [b.info for b in self._batches.values() if b.info.owner == owner]
        mine = [i for i in mine if before is None or i.created_at < before]
        return sorted(mine, key=lambda i: -i.created_at)[:limit]

    def _set(self, b: _Batch, **changes: object) -> None:
        b.info = dataclasses.replace(b.info, **changes)  # type: ignore[arg-type]

    def _enter(self, b: _Batch, state: BatchState, **changes: object) -> None:
        self._set(b, state=state, times=MappingProxyType({**b.info.times, state.value: time.time()}), **changes)

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        if b is None:
            return None
        if b.info.state in (BatchState.VALIDATING, BatchState.IN_PROGRESS, BatchState.CANCELLING):
            if b.info.state is not BatchState.CANCELLING:
                self._enter(b, BatchState.CANCELLING)
            await self.settle(batch_id)
        return b.info

    async def settle(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        if b is None or (b.info.state.ended and b.info.state is not BatchState.FAILED):
            return b.info if b else None
        if b.info.state is BatchState.IN_PROGRESS:
            if time.time() <= b.info.expires_at:
                return b.info
            b.closing = True
            status = ItemStatus.EXPIRED
        else:
            status = ItemStatus.CANCELLED
        for cid in b.ids:
            if cid not in b.started and cid not in b.done:
                self._add(b, ItemResult.unrun(cid, status, f"the batch ended ({b.info.state.value}) before it started"))
        self._finish(b)
        await self._notify()
        return b.info

    async def sweep(self, limit: int = 100) -> int:
        due = [b for b in self._batches.values() if not b.info.state.ended and time.time() > b.info.expires_at]
        for b in due[:limit]:
            await self.settle(b.info.batch_id)
        return len(due[:limit])

    async def open_batches(self, limit: int = 1000) -> list[BatchInfo]:
        return [b.info for b in self._batches.values() if not b.info.state.ended][:limit]

    async def results(self, batch_id: str, after: str, block_ms: int | None) -> list[tuple[str, ItemResult]]:
        b = self._batches.get(batch_id)
        if b is None:
            return []

        def newer() -> list[tuple[str, ItemResult]]:
            return [(c, r) for c, r in b.results if _id(c) > _id(after)]

        await self._wait(lambda: bool(newer()), block_ms)
        return newer()

    async def join(self, pool: str) -> None:
        return None

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        await self._wait(lambda: self.lanes.ready(pool), block_ms)
        out = []
        for entry_id, req in self.lanes.take(pool, consumer, count):
            b = self._batches.get(req.batch_id)
            late = b is not None and (b.closing or time.time() > b.info.expires_at)
            gone = b is None or b.info.state is not BatchState.IN_PROGRESS
            if b is not None and not gone and not late:
                b.started.add(req.custom_id)
            out.append(Lease(pool=pool, entry_id=entry_id, request=req, cancelled=gone, expired=late and not gone))
        return out

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        return []

    async def touch(self, pool: str, consumer: str, refs: Sequence[str]) -> list[str]:
        return []  # nothing is taken over in memory (reclaim returns none)

    async def discard(self, lease: Lease) -> None:
        self.lanes.ack(lease.pool, lease.entry_id)

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        req = lease.request
        b = self._batches.get(req.batch_id)
        await self.discard(lease)
        if b is None or req.custom_id in b.done:
            return False
        self._add(b, result)
        i = b.info
        if self.fail_after and i.state is BatchState.IN_PROGRESS and i.succeeded == 0 and i.errored >= self.fail_after:
            self._enter(b, BatchState.FAILED)
            await self.settle(req.batch_id)
        self._finish(b)
        await self._notify()
        return True

    def _add(self, b: _Batch, result: ItemResult) -> None:
        b.done[result.custom_id] = result.status.value
        b.results.append((self._result_id(), result))
        self._set(
            b,
            **{result.status.value: getattr(b.info, result.status.value) + 1},
            prompt_tokens=b.info.prompt_tokens + result.usage.prompt_tokens,
            completion_tokens=b.info.completion_tokens + result.usage.completion_tokens,
            cached_tokens=b.info.cached_tokens + result.usage.cached_tokens,
        )

    def _finish(self, b: _Batch) -> None:
        i = b.info
        if i.processing or i.state not in (BatchState.IN_PROGRESS, BatchState.CANCELLING, BatchState.FAILED):
            return
        now = time.time()
        if i.state is not BatchState.FAILED and not i.results_expire_at:
            final = (
                BatchState.CANCELLED
                if i.state is BatchState.CANCELLING
                else BatchState.EXPIRED
                if i.expired
                else BatchState.COMPLETED
            )
            self._set(
                b, state=final, times=MappingProxyType({**i.times, BatchState.FINALIZING.value: now, final.value: now})
            )
        if not b.info.results_expire_at:
            self._set(b, results_expire_at=now)
        if not b.info.processing:
            self.lanes.close(i.batch_id)


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)
