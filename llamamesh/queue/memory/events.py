"""A request's events in memory: appended by ``publish`` (a terminal event acks its job) and ``end``,
followed by ``events``, which merges what queued up unread as Redis's follower does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from llamamesh.queue.memory.state import MemoryState
from llamamesh.queue.protocol import Lease, entry_order
from llamamesh.types import GenerationRequest, JobEvent


class MemoryEvents(MemoryState):
    async def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        async for item in self.events_within(request_id, None, after):
            if item is not None:
                yield item

    async def events_within(
        self, request_id: str, idle_s: float | None, after: str = "0-0"
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        loop = asyncio.get_running_loop()
        seen = entry_order(after)
        idle_at = loop.time() + (idle_s or 0.0)  # idle: none of this request's events since then
        while True:
            self._check()
            fresh = [(i, e) for i, e in self._events.get(request_id, []) if entry_order(i) > seen]
            for entry_id, event in _merged(fresh):
                seen = entry_order(entry_id)
                yield entry_id, event
                if event.terminal:
                    return
            if fresh:
                idle_at = loop.time() + (idle_s or 0.0)
                continue
            idle = False
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), None if idle_s is None else idle_at - loop.time())
                except asyncio.TimeoutError:
                    idle = True
            if idle:
                idle_at = loop.time() + (idle_s or 0.0)
                yield None

    async def end(self, request_id: str, event: JobEvent) -> None:
        self._check()
        self._events.setdefault(request_id, []).append((self._next_id(), event))
        await self._notify()

    async def read_events(self, request_id: str) -> list[tuple[str, JobEvent]]:
        self._check()
        return list(self._events.get(request_id, ()))

    async def last_event(self, request_id: str) -> tuple[int, JobEvent | None]:
        self._check()
        got = self._events.get(request_id, ())
        return len(got), got[-1][1] if got else None

    async def publish(self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]) -> set[str]:
        self._check()
        for lease, event in events:
            self._events.setdefault(lease.request.request_id, []).append((self._next_id(), event))
            if event.terminal:
                self._pool(lease.pool).acked(lease.entry_id)
        await self._notify()
        return {r.request_id for r in watch if self._is_cancelled(r)}


def _merged(fresh: Sequence[tuple[str, JobEvent]]) -> list[tuple[str, JobEvent]]:
    """What queued up unread, as ``Jobs.events`` may deliver it: each run of events that follow on
    as one (under its last id); a failure, a repeat or a gap on its own; nothing past a terminal."""
    out: list[tuple[str, list[JobEvent]]] = []
    for entry_id, ev in fresh:
        if out and not out[-1][1][-1].terminal and ev.failed is None and out[-1][1][-1].follows_on(ev):
            out[-1][1].append(ev)
            out[-1] = (entry_id, out[-1][1])
        else:
            out.append((entry_id, [ev]))
    return [(entry_id, JobEvent.joined(run)) for entry_id, run in out]
