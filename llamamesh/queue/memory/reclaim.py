"""Reclaim in memory: nothing to take over (one process: no worker dies apart from it), and the dead
letters (``dead``), for tests to look at."""

from __future__ import annotations

from collections.abc import Collection

from llamamesh.queue.memory.state import MemoryState
from llamamesh.queue.protocol import Lease
from llamamesh.types import GenerationRequest


class MemoryReclaim(MemoryState):
    async def reclaim(
        self,
        pool: str,
        consumer: str,
        min_idle_ms: int,
        count: int,
        max_deliveries: int,
        own: bool = False,
        running: Collection[str] = (),
    ) -> list[Lease]:
        self._check()
        return []

    async def set_aside(self, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        self._check()
        self.dead.append((pool, request, reason, deliveries))
