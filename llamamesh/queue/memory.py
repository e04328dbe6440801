"""In-memory fake of the queue with the same contract as ``streams.RedisQueue``.

For unit and in-process tests of one layer; never the only proof of anything.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.protocol import Lease
from llamamesh.types import GenerationRequest, JobEvent, WorkerStatus


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
