"""Submission in memory: a job onto its tenant's FIFO of the pool (pool.py), with its partition when
prefix affinity is on (``affinity.partition_of``, or balanced ``affinity.Placements``, as on Redis)."""

from __future__ import annotations

import time

from llamamesh.errors import QueueFull
from llamamesh.queue.affinity import Placements, partition_of, placement_field
from llamamesh.queue.keys import stream_tenant
from llamamesh.queue.memory.state import MemoryState
from llamamesh.types import GenerationRequest


class MemorySubmission(MemoryState):
    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        self._check()
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be positive, not {weight!r}")
        tenant = stream_tenant(request.tenant)
        waiting = self._pool(pool).tenants.setdefault(tenant, [])
        if 0 < max_waiting <= len(waiting):
            whose = f"tenant {tenant!r} has" if tenant else "has"
            n = len(waiting)
            raise QueueFull(f"pool {pool!r} {whose} {n} requests waiting (at most {max_waiting}); retry later")
        self.weights.setdefault(pool, {})[tenant] = weight
        entry_id = self._next_id()
        if self._parts:
            self._pool(pool).part[entry_id] = self._partition(pool, tenant, request)
            self._pool(pool).born[entry_id] = time.monotonic()
        waiting.append((entry_id, request))
        self.queued_in[(pool, request.request_id)] = self._epoch
        await self._notify()

    async def queued(self, pool: str, request_id: str) -> bool:
        self._check()
        return self.queued_in.get((pool, request_id)) == self._epoch

    def _partition(self, pool: str, tenant: str, request: GenerationRequest) -> int:
        """The job's partition: its key's hash, or (balanced) where its key is placed."""
        hashed = partition_of(request, self._parts)
        if not (self._balanced and request.prefix_key):
            return hashed
        placements = self._placements.setdefault(pool, Placements(self._placement_ttl_ms))
        key = placement_field(tenant, request.prefix_key)
        now_ms = int(time.monotonic() * 1000)
        return placements.place(key, hashed, self._parts, self._pool(pool).owners, now_ms)

    async def join(self, pool: str) -> None:
        self._check()
        self._pool(pool)
