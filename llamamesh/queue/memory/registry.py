"""The registry of each pool's workers in memory: heartbeats that expire, the pool's depth, and with
prefix affinity on, each ready worker's share of the partitions (``affinity.assign``, as on Redis)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from llamamesh.queue.affinity import assign
from llamamesh.queue.memory.pool import Pool
from llamamesh.queue.memory.state import MemoryState
from llamamesh.queue.protocol import QueueDepth
from llamamesh.types import WorkerStatus


class MemoryRegistry(MemoryState):
    async def workers(self, pool: str) -> list[WorkerStatus]:
        self._check()
        now = time.monotonic()
        beats = self._beats.get(pool, {})
        for name in [n for n, (until, _s) in beats.items() if until <= now]:
            del beats[name]
        return [s for _n, (_u, s) in sorted(beats.items())]

    async def queue_depth(self, pool: str) -> QueueDepth:
        self._check()
        p = self._pool(pool)
        return QueueDepth(sum(len(q) for q in p.tenants.values()), len(p.pending))

    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> list[str]:
        self._check()
        self._beats.setdefault(status.pool, {})[status.worker] = (time.monotonic() + ttl_s, status)
        if self._parts:
            p = self._pool(status.pool)
            if status.ready:
                now_ms = int(time.monotonic() * 1000)
                p.owners, p.members, _mine = assign(
                    p.owners, p.members, status.worker, now_ms, int(ttl_s * 1000), self._parts
                )
            else:
                _release(p, status.worker)
        return []  # nothing is taken over in memory (reclaim.py)

    def owned(self, pool: str, worker: str) -> list[int]:
        """The partitions the worker owns now (affinity on; an owner's lease may have expired)."""
        return sorted(k for k, (w, _u) in self._pool(pool).owners.items() if w == worker)

    async def leave(self, pool: str, worker: str) -> None:
        self._check()
        self._beats.get(pool, {}).pop(worker, None)
        _release(self._pool(pool), worker)


def _release(p: Pool, worker: str) -> None:
    p.members.pop(worker, None)
    p.owners = {k: o for k, o in p.owners.items() if o[0] != worker}
