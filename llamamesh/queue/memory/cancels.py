"""A request's cancel flags in memory: its own and its caller's (a Cancel that came ahead of its
Generate holds ``CANCEL_AHEAD_TTL_S``, then as long as the request)."""

from __future__ import annotations

import time

from llamamesh.queue.memory.state import MemoryState


class MemoryCancels(MemoryState):
    async def cancel(self, request_id: str) -> None:
        self._check()
        self._cancelled.add(request_id)
        await self._notify()

    async def call_off(self, caller_id: str) -> None:
        self._check()
        if caller_id in self._attempts:
            self._called_off[caller_id] = ("1", float("inf"))
        else:
            self._called_off[caller_id] = ("a", time.monotonic() + _ahead_s())
        await self._notify()


def _ahead_s() -> float:
    # Read from the package at each call: tests shorten ``llamamesh.queue.memory.CANCEL_AHEAD_TTL_S``.
    from llamamesh.queue import memory

    return float(memory.CANCEL_AHEAD_TTL_S)
