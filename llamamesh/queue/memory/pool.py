"""A pool's work in memory: each tenant's FIFO of jobs (with prefix affinity, each job's partition),
the jobs leased and not acked, and who owns which partition. Batch items use ``waiting`` alone.

Fair share is simpler than on Redis: plain round robin over the tenants with work (one job per
tenant per turn), their weights unused; Redis does weighted deficit round robin (fair.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from llamamesh.queue.protocol import entry_order
from llamamesh.types import GenerationRequest


@dataclass
class Pool:
    waiting: list[tuple[str, GenerationRequest]] = field(default_factory=list)
    # entry id -> (consumer, request): leased, not yet acked
    pending: dict[str, tuple[str, GenerationRequest]] = field(default_factory=dict)
    # Jobs only (batch items use ``waiting``): tenant -> its FIFO, and the tenant served last.
    tenants: dict[str, list[tuple[str, GenerationRequest]]] = field(default_factory=dict)
    last: str | None = None
    # Prefix affinity: entry id -> its partition; partition -> (owner, expiry ms); ready worker ->
    # its membership's expiry (ms).
    part: dict[str, int] = field(default_factory=dict)
    born: dict[str, float] = field(default_factory=dict)  # entry id -> when it was queued (monotonic s)
    owners: dict[int, tuple[str, int]] = field(default_factory=dict)
    members: dict[str, int] = field(default_factory=dict)

    def queued(self) -> list[tuple[str, GenerationRequest]]:
        """Every tenant's waiting jobs, in the order they were submitted."""
        return sorted((e for q in self.tenants.values() for e in q), key=lambda e: entry_order(e[0]))

    def take(
        self,
        count: int,
        exclude: Collection[str] = (),
        partitions: Collection[int] | None = None,
        queued_before: float | None = None,
    ) -> list[tuple[str, GenerationRequest]]:
        """Up to ``count`` jobs, one per tenant with work per turn (round robin), none of ``exclude``;
        only of ``partitions`` when given (each tenant's oldest job there), queued before
        ``queued_before`` (monotonic s) when given."""
        taken: list[tuple[str, GenerationRequest]] = []
        while len(taken) < count:
            heads = {
                t: i
                for t, q in self.tenants.items()
                if t not in exclude
                if (i := self._head(q, partitions, queued_before)) is not None
            }
            ready = sorted(heads)
            if not ready:
                break
            tenant = next((t for t in ready if self.last is None or t > self.last), ready[0])
            taken.append(self.tenants[tenant].pop(heads[tenant]))
            self.last = tenant
        return taken

    def head_any(self, partitions: Collection[int], exclude: Collection[str]) -> bool:
        """Whether a job of ``partitions`` waits (of a tenant not in ``exclude``)."""
        return any(self._head(q, partitions) is not None for t, q in self.tenants.items() if t not in exclude)

    def _head(
        self,
        queue: list[tuple[str, GenerationRequest]],
        partitions: Collection[int] | None,
        queued_before: float | None = None,
    ) -> int | None:
        if partitions is None:
            return 0 if queue else None
        for i, (eid, _r) in enumerate(queue):
            if queued_before is not None and self.born.get(eid, 0.0) > queued_before:
                return None  # the rest came later still
            if self.part.get(eid) in partitions:
                return i
        return None

    def acked(self, entry_id: str) -> None:
        """Forget a job that ended."""
        self.pending.pop(entry_id, None)
        self.part.pop(entry_id, None)
        self.born.pop(entry_id, None)
