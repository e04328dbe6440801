"""Leasing in memory: round robin over the tenants with work (pool.py); with prefix affinity on, from
the worker's own partitions first, then the oldest of the others' (a steal, only of jobs that waited
``steal_after_ms``), waiting on its own for at most ``steal_after_ms`` at a time."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Collection

from llamamesh.queue.keys import stream_tenant
from llamamesh.queue.memory.registry import MemoryRegistry
from llamamesh.queue.protocol import Lease
from llamamesh.types import GenerationRequest


class MemoryLeasing(MemoryRegistry):
    async def lease(
        self, pool: str, consumer: str, count: int, block_ms: int, exclude: Collection[str] = ()
    ) -> list[Lease]:
        self._check()
        p = self._pool(pool)
        left_out = {stream_tenant(t) for t in exclude}
        if self._parts:
            return await self._lease_parts(pool, consumer, count, block_ms, left_out)

        def waiting() -> bool:
            return any(q for t, q in p.tenants.items() if t not in left_out)

        if not waiting():
            if block_ms <= 0:
                return []
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(waiting), block_ms / 1000)
                except asyncio.TimeoutError:
                    return []
        return self._leased(pool, consumer, p.take(count, left_out), stolen=False)

    async def _lease_parts(
        self, pool: str, consumer: str, count: int, block_ms: int, left_out: set[str]
    ) -> list[Lease]:
        """Affinity on: own partitions first, then a steal, waiting on its own ``steal_after_ms`` at
        a time until ``block_ms`` is over."""
        p = self._pool(pool)
        deadline = time.monotonic() + block_ms / 1000
        while True:
            owned = set(self.owned(pool, consumer))
            others = set(range(self._parts)) - owned
            stolen = False
            taken = p.take(count, left_out, owned) if owned else []
            if not taken and others:  # a steal: only jobs that waited steal_after_ms
                steal_before = time.monotonic() - self._steal_after_ms / 1000
                taken, stolen = p.take(count, left_out, others, steal_before), True
            left = deadline - time.monotonic()
            if taken or block_ms <= 0 or left <= 0:
                break
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait_for(functools.partial(p.head_any, owned, left_out)),
                        min(left, self._steal_after_ms / 1000),
                    )
        return self._leased(pool, consumer, taken, stolen)

    def _leased(
        self, pool: str, consumer: str, taken: list[tuple[str, GenerationRequest]], stolen: bool
    ) -> list[Lease]:
        p = self._pool(pool)
        for entry_id, req in taken:
            p.pending[entry_id] = (consumer, req)
        return [
            Lease(
                pool=pool,
                entry_id=i,
                request=r,
                cancelled=self._is_cancelled(r),
                tenant=stream_tenant(r.tenant),
                partition=p.part.get(i),
                stolen=stolen,
            )
            for i, r in taken
        ]
