"""The two faces of the queue: what the gateway needs and what a worker needs.

``streams.RedisQueue`` implements both on Redis Streams; ``memory.MemoryQueue``
is the in-memory fake with the same contract, for tests of one layer.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from llamamesh.types import GenerationRequest, JobEvent, WorkerStatus


@dataclass(frozen=True)
class Lease:
    """A job handed to one worker through the pool's consumer group."""

    pool: str
    entry_id: str
    request: GenerationRequest
    # True when the caller cancelled before the worker leased it (for a batch item: its batch).
    cancelled: bool = False
    # A batch item leased after its batch's deadline: it ends expired, unrun.
    expired: bool = False


class JobQueue(Protocol):
    """The gateway's side: submit, follow a request's events, cancel."""

    async def submit(self, pool: str, request: GenerationRequest) -> None:
        """Append the job to the pool's work stream. Raises QueueUnavailable."""

    def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        """Yield (event id, event) after ``after`` as they arrive, ending after the terminal event.
        Events that queued up unread may come merged into one (``JobEvent.then``; never a failure),
        under the id of the last of them.

        Blocks between events; cancelling the iterating task stops it. Raises QueueUnavailable.
        """
        ...

    async def cancel(self, request_id: str) -> None:
        """Mark the request cancelled: a queued job is skipped, a running one aborted."""

    async def ping(self) -> None:
        """Raise QueueUnavailable unless the queue answers."""

    async def workers(self, pool: str) -> list[WorkerStatus]:
        """The live workers of a pool: those whose last heartbeat has not expired."""
        ...

    async def close(self) -> None: ...


class WorkQueue(Protocol):
    """A worker's side: lease jobs from a pool, publish their events, ack them."""

    async def join(self, pool: str) -> None:
        """Create the pool's work stream and consumer group if missing."""

    async def lease(self, pool: str, consumer: str, count: int, block_ms: int) -> list[Lease]:
        """Take up to ``count`` new jobs, waiting at most ``block_ms`` for the first."""
        ...

    async def heartbeat(self, status: WorkerStatus, ttl_s: float) -> None:
        """Say this worker is alive (with its figures) for the next ``ttl_s`` seconds."""

    async def leave(self, pool: str, worker: str) -> None:
        """Withdraw this worker's heartbeat (a clean stop)."""

    async def publish(self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[str]) -> set[str]:
        """Write events in one round trip, in order.

        A terminal event also expires the event stream and acks the lease. Returns
        the ids among ``watch`` (requests in flight) that are cancelled.
        """
        ...

    async def close(self) -> None: ...
