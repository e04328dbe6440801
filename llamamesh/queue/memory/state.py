"""What every part of the in-memory queue shares: the pools, the events, the flags and records, one
condition that wakes every waiter on any change, and the switches tests turn (``down``, ``full``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

from llamamesh.errors import QueueOutOfMemory, QueueUnavailable
from llamamesh.queue.affinity import Placements
from llamamesh.queue.memory.pool import Pool
from llamamesh.types import Attempt, GenerationRequest, JobEvent, WorkerStatus


class MemoryState:
    """The fake's state (``MemoryQueue`` is this with every role's calls). ``down = True`` makes every
    call fail; ``full = True`` every write, as a Redis at its maxmemory."""

    def __init__(
        self, partitions: int = 0, steal_after_ms: int = 50, placement: str = "hash", placement_ttl_s: float = 600.0
    ) -> None:
        self._parts = partitions
        # Balanced placement of prefix keys (affinity on): pool -> its placements.
        self._balanced = placement == "balanced"
        self._placement_ttl_ms = max(1, int(placement_ttl_s * 1000))
        self._placements: dict[str, Placements] = {}
        self._steal_after_ms = steal_after_ms
        self._pools: dict[str, Pool] = {}
        self._events: dict[str, list[tuple[str, JobEvent]]] = {}
        self._cancelled: set[str] = set()
        # caller id -> ("a": ahead of its Generate, until the deadline; "1": while its request lives)
        self._called_off: dict[str, tuple[str, float]] = {}
        self._epoch = uuid.uuid4().hex
        # (pool, request id) -> the epoch its job was queued in: ``queued`` (a lost epoch's are not).
        self.queued_in: dict[tuple[str, str], str] = {}
        self.dead: list[tuple[str, GenerationRequest, str, int]] = []
        self._attempts: dict[str, list[Attempt]] = {}
        self._adapters: dict[str, dict[str, str]] = {}  # pool -> run-time LoRA adapters
        self._attaches: dict[str, int] = {}
        self._readers: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        # pool -> worker -> (monotonic expiry, status)
        self._beats: dict[str, dict[str, tuple[float, WorkerStatus]]] = {}
        # pool -> tenant -> the weight its latest submission gave (inspection only)
        self.weights: dict[str, dict[str, float]] = {}
        self.down = False
        # Tests: the policy a Redis at its maxmemory would evict keys by ("": none, as noeviction).
        self.evicts = ""
        self.full = False

    def _check(self) -> None:
        if self.down:
            raise QueueUnavailable("the queue is unreachable")

    def _check_write(self) -> None:
        """Tests: ``full`` is a Redis at its maxmemory (reads answer, writes are refused)."""
        self._check()
        if self.full:
            raise QueueOutOfMemory("Redis is full", retry_after_s=5.0)

    def _pool(self, pool: str) -> Pool:
        return self._pools.setdefault(pool, Pool())

    def _next_id(self) -> str:
        return f"{next(self._ids)}-0"

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _is_cancelled(self, req: GenerationRequest) -> bool:
        off = self._called_off.get(req.caller_id)
        return req.request_id in self._cancelled or (off is not None and off[1] > time.monotonic())

    # ---- the queue's state ---------------------------------------------------
    async def epoch(self) -> str:
        self._check()
        return self._epoch

    def lose_data(self) -> None:
        """Tests: what a Redis that came back empty looks like (a new epoch)."""
        self._epoch = uuid.uuid4().hex

    async def ping(self) -> None:
        self._check()

    async def check_writes(self) -> None:
        self._check_write()

    async def preflight(self) -> None:
        self._check()

    async def eviction(self) -> str:
        self._check()
        return self.evicts

    async def close(self) -> None:
        return None

    # ---- inspection for tests ------------------------------------------------
    def pending(self, pool: str) -> dict[str, tuple[str, GenerationRequest]]:
        return dict(self._pool(pool).pending)

    def waiting(self, pool: str) -> list[GenerationRequest]:
        return [r for _i, r in self._pool(pool).queued()]

    def events_of(self, request_id: str) -> list[JobEvent]:
        return [e for _i, e in self._events.get(request_id, [])]

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled
