"""In-memory fake of the queue with the same contract as ``streams.RedisQueue``.

For unit and in-process tests of one layer; never the only proof of anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue.protocol import Lease
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, JobEvent, WorkerStatus


@dataclass
class _Pool:
    waiting: list[tuple[str, GenerationRequest]] = field(default_factory=list)
    # entry id -> (consumer, request): leased, not yet acked
    pending: dict[str, tuple[str, GenerationRequest]] = field(default_factory=dict)


class MemoryQueue:
    """JobQueue and WorkQueue in one process. ``down = True`` makes every call fail."""

    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._events: dict[str, list[tuple[str, JobEvent]]] = {}
        self._cancelled: set[str] = set()
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        # pool -> worker -> (monotonic expiry, status)
        self._beats: dict[str, dict[str, tuple[float, WorkerStatus]]] = {}
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise QueueUnavailable("the queue is unreachable")

    def _pool(self, pool: str) -> _Pool:
        return self._pools.setdefault(pool, _Pool())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- inspection for tests ----------------------------------------------
    def pending(self, pool: str) -> dict[str, tuple[str, GenerationRequest]]:
        return dict(self._pool(pool).pending)

    def waiting(self, pool: str) -> list[GenerationRequest]:
        return [r for _i, r in self._pool(pool).waiting]

    def events_of(self, request_id: str) -> list[JobEvent]:
        return [e for _i, e in self._events.get(request_id, [])]

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    # ---- gateway side -------------------------------------------------------
    async def submit(self, pool: str, request: GenerationRequest) -> None:
        self._check()
        self._pool(pool).waiting.append((f"{next(self._ids)}-0", request))
        await self._notify()

    async def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        seen = _seq(after)
        while True:
            self._check()
            fresh = [(i, e) for i, e in self._events.get(request_id, []) if _seq(i) > seen]
            for entry_id, event in fresh:
                seen = _seq(entry_id)
                yield entry_id, event
                if event.terminal:
                    return
            if not fresh:
                async with self._changed:
                    await self._changed.wait()

    async def cancel(self, request_id: str) -> None:
        self._check()
        self._cancelled.add(request_id)
        await self._notify()

    async def ping(self) -> None:
        self._check()

    async def workers(self, pool: str) -> list[WorkerStatus]:
        self._check()
        now = time.monotonic()
        beats = self._beats.get(pool, {})
        for name in [n for n, (until, _s) in beats.items() if until <= now]:
            del beats[name]
        return [s for _n, (_u, s) in sorted(beats.items())]

    async def close(self) -> None:
        return None

    # ---- worker side --------------------------------------------------------
    async def join(self, pool: str) -> None:
        self._check()
        self._pool(pool)

    async def lease(self, pool: str, consumer: str, count: int, block_ms: int) -> list[Lease]:
        self._check()
        p = self._pool(pool)
        if not p.waiting:
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: bool(p.waiting)), block_ms / 1000)
                except asyncio.TimeoutError:
                    return []
        taken, p.waiting = p.waiting[:count], p.waiting[count:]
        for entry_id, req in taken:
            p.pending[entry_id] = (consumer, req)
        return [
            Lease(pool=pool, entry_id=i, request=r, cancelled=r.request_id in self._cancelled)
            for i, r in taken
        ]

    async def heartbeat(self, status: WorkerStatus, ttl_s: float) -> None:
        self._check()
        self._beats.setdefault(status.pool, {})[status.worker] = (time.monotonic() + ttl_s, status)

    async def leave(self, pool: str, worker: str) -> None:
        self._check()
        self._beats.get(pool, {}).pop(worker, None)

    async def publish(self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[str]) -> set[str]:
        self._check()
        for lease, event in events:
            self._events.setdefault(lease.request.request_id, []).append((f"{next(self._ids)}-0", event))
            if event.terminal:
                self._pool(lease.pool).pending.pop(lease.entry_id, None)
        await self._notify()
        return {rid for rid in watch if rid in self._cancelled}


def _seq(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Batch:
    info: BatchInfo
    fingerprint: str
    done: dict[str, str] = field(default_factory=dict)
    results: list[tuple[str, ItemResult]] = field(default_factory=list)


class MemoryBatches:
    """BatchStore in one process, same contract as ``batches.RedisBatches`` (no reclaim: nothing
    here dies separately)."""

    def __init__(self) -> None:
        self._batches: dict[str, _Batch] = {}
        self._items: dict[str, _Pool] = {}
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)

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
                raise InvalidRequest.field("batch_id", f"batch {info.batch_id!r} exists with other items")
            return have.info, False
        now = time.time()
        times = {BatchState.VALIDATING.value: info.created_at, BatchState.IN_PROGRESS.value: now}
        stored = dataclasses.replace(info, state=BatchState.IN_PROGRESS, times=MappingProxyType(times))
        self._batches[info.batch_id] = _Batch(stored, fingerprint)
        for pool, req in items:
            self._items.setdefault(pool, _Pool()).waiting.append((f"{next(self._ids)}-0", req))
        await self._notify()
        return stored, True

    async def get(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        return b.info if b is not None else None

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        mine = [b.info for b in self._batches.values() if b.info.owner == owner]
        mine = [i for i in mine if before is None or i.created_at < before]
        return sorted(mine, key=lambda i: -i.created_at)[:limit]

    def _set(self, b: _Batch, **changes: object) -> None:
        b.info = dataclasses.replace(b.info, **changes)  # type: ignore[arg-type]

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        if b is None:
            return None
        if b.info.state in (BatchState.VALIDATING, BatchState.IN_PROGRESS):
            times = {**b.info.times, BatchState.CANCELLING.value: time.time()}
            self._set(b, state=BatchState.CANCELLING, times=MappingProxyType(times))
        return b.info

    async def results(self, batch_id: str, after: str, block_ms: int | None) -> list[tuple[str, ItemResult]]:
        b = self._batches.get(batch_id)
        if b is None:
            return []

        def newer() -> list[tuple[str, ItemResult]]:
            return [(c, r) for c, r in b.results if int(c.split("-")[0]) > int(after.split("-")[0])]

        await self._wait(lambda: bool(newer()), block_ms)
        return newer()

    async def join(self, pool: str) -> None:
        self._items.setdefault(pool, _Pool())

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        p = self._items.setdefault(pool, _Pool())
        await self._wait(lambda: bool(p.waiting), block_ms)
        taken, p.waiting = p.waiting[:count], p.waiting[count:]
        now = time.time()
        out = []
        for entry_id, req in taken:
            p.pending[entry_id] = (consumer, req)
            b = self._batches.get(req.batch_id)
            gone = b is None or b.info.state in (BatchState.CANCELLING, BatchState.CANCELLED)
            late = b is not None and now > b.info.expires_at
            out.append(Lease(pool=pool, entry_id=entry_id, request=req, cancelled=gone, expired=late))
        return out

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        return []

    async def touch(self, pool: str, consumer: str, entry_ids: Sequence[str]) -> None:
        return None

    async def discard(self, lease: Lease) -> None:
        self._items.setdefault(lease.pool, _Pool()).pending.pop(lease.entry_id, None)

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        req = lease.request
        b = self._batches.get(req.batch_id)
        await self.discard(lease)
        if b is None or req.custom_id in b.done:
            return False
        b.done[req.custom_id] = result.status.value
        b.results.append((f"{next(self._ids)}-0", result))
        counts = {result.status.value: getattr(b.info, result.status.value) + 1}
        self._set(b, **counts)
        i = b.info
        if i.processing == 0 and i.state in (BatchState.IN_PROGRESS, BatchState.CANCELLING):
            final = (BatchState.CANCELLED if i.state is BatchState.CANCELLING
                     else BatchState.EXPIRED if i.expired else BatchState.COMPLETED)  # fmt: skip
            now = time.time()
            times = {**i.times, BatchState.FINALIZING.value: now, final.value: now}
            self._set(b, state=final, times=MappingProxyType(times), results_expire_at=now)
        await self._notify()
        return True
