"""The attempts log in memory: each caller's attempts and re-attach count."""

from __future__ import annotations

import time

from llamamesh.queue.memory.state import MemoryState
from llamamesh.types import Attempt


class MemoryAttempts(MemoryState):
    async def begin(self, caller_id: str, attempt: Attempt, first: bool) -> bool:
        self._check_write()
        if first and caller_id in self._attempts:
            return False
        off = self._called_off.pop(caller_id, None) if caller_id not in self._attempts else None
        if off is not None and off[0] == "a" and off[1] > time.monotonic():  # a Cancel that came first holds
            self._called_off[caller_id] = ("1", float("inf"))
        self._attempts.setdefault(caller_id, []).append(attempt)
        return True

    async def forget(self, caller_id: str) -> None:
        self._attempts.pop(caller_id, None)

    async def attempts(self, caller_id: str) -> list[Attempt]:
        self._check()
        return list(self._attempts.get(caller_id, ()))

    async def attach(self, caller_id: str) -> int:
        self._check()
        self._attaches[caller_id] = self._attaches.get(caller_id, 0) + 1
        return self._attaches[caller_id]

    async def attach_count(self, caller_id: str) -> int:
        return self._attaches.get(caller_id, 0)

    async def reading(self, caller_id: str, delta: int) -> int:
        self._check()
        self._readers[caller_id] = self._readers.get(caller_id, 0) + delta
        return self._readers[caller_id]
