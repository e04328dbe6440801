"""The roles of the queue: what the gateway needs and what a worker needs, and the batch store
(the gateway's own stores, the tenants' budgets and the uploaded files: gateway_stores.py).

``streams.RedisQueue`` implements the queue's on Redis Streams (a module per role), ``batches.
RedisBatches`` the batch store; ``memory`` holds the in-memory fakes with the same contracts, for
tests of one layer.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from llamamesh.types import (
    Attempt,
    BatchInfo,
    GenerationRequest,
    ItemResult,
    JobEvent,
    WorkerStatus,
)


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
    # A reclaimed job a dead worker had already begun (its event stream has entries): its caller has
    # tokens of it, so it must not run again from the start; ``begun`` holds those events, from which
    # the worker that reclaimed it goes on (workers/carry_on.py).
    started: bool = False
    begun: tuple[JobEvent, ...] = ()
    # The tenant whose work stream of the pool holds the entry (``Keys.jobs(pool, tenant)``; "":
    # the default tenant's): where it is acked, touched and reclaimed.
    tenant: str = ""
    # Prefix affinity on: the partition of the tenant's work stream that holds it
    # (``Keys.jobs_part``), and whether the worker took it from a partition another owns (a steal).
    # None: the tenant's one stream (affinity off).
    partition: int | None = None
    stolen: bool = False
    # A batch item from the pool's shared batch stream (``Keys.batch_items``), not its batch's lane.
    shared: bool = False

    @property
    def item_ref(self) -> str:
        """A batch item among the pool's batch streams: ``<entry id>@<batch id>`` in its batch's lane,
        the entry id alone in the shared stream. What ``BatchStore.touch`` takes."""
        return self.entry_id if self.shared else f"{self.entry_id}@{self.request.batch_id}"

    @property
    def ref(self) -> str:
        """The entry among all the pool's work streams (entry ids repeat across streams): its entry
        id for the default tenant's stream, else ``<entry id>@<tenant>``, and ``#<partition>`` after
        it with affinity on. What ``heartbeat``'s ``touch`` and ``reclaim``'s ``running`` take."""
        return entry_ref(self.tenant, self.entry_id, self.partition)


def entry_ref(tenant: str, entry_id: str, partition: int | None = None) -> str:
    """``Lease.ref`` of the entry ``entry_id`` of ``tenant``'s work stream (or of its partition)."""
    if partition is not None:
        return f"{entry_id}@{tenant}#{partition}"
    return f"{entry_id}@{tenant}" if tenant else entry_id


def parse_ref(ref: str) -> tuple[str, str]:
    """(tenant, entry id) of a ``Lease.ref``."""
    tenant, _partition, entry_id = split_ref(ref)
    return tenant, entry_id


def split_ref(ref: str) -> tuple[str, int | None, str]:
    """(tenant, partition or None, entry id) of a ``Lease.ref``."""
    entry_id, _, where = ref.partition("@")
    tenant, sep, partition = where.partition("#")
    return tenant, int(partition) if sep else None, entry_id


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``, or ``<ms>``) as it sorts."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Jobs(Protocol):
    """The work a gateway hands out and follows: a pool's work stream, a request's events and
    cancel flags, the dead-letter stream."""

    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        """Append the job to its tenant's work stream of the pool (``request.tenant``), whose share
        of the pool's workers against the other tenants with work waiting is ``weight`` (> 0; the
        latest submission's weight counts). With ``max_waiting`` > 0, raises QueueFull instead when
        that many jobs of the tenant already wait there unleased (a bound per tenant: one tenant
        cannot fill the pool for the others). Raises QueueUnavailable."""

    async def queued(self, pool: str, request_id: str) -> bool:
        """Whether the job was queued to the pool in the data Redis holds now (its submitted marker,
        kept ``Retention.submitted_s``, is there): after Redis came back without its data, a job
        queued since is not lost. Raises QueueUnavailable."""
        ...

    def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        """Yield (event id, event) after ``after`` as they arrive, ending after the terminal event.
        Events that queued up unread may come merged into one (``JobEvent.then``; never a failure,
        and only events that follow on), under the id of the last of them. A repeated event (a
        writer's retry) comes as it is: its reader drops what it has (services/cursor.py).

        Blocks between events; cancelling the iterating task stops it. Raises QueueUnavailable.
        """
        ...

    def events_within(
        self, request_id: str, idle_s: float, after: str = "0-0"
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        """``events``, and None each time ``idle_s`` passes without one (the relay checks its
        worker's liveness then), without a timer or a task per event."""
        ...

    async def cancel(self, request_id: str) -> None:
        """Mark the request cancelled: a queued job is skipped, a running one aborted."""

    async def call_off(self, caller_id: str) -> None:
        """The caller's Cancel: every attempt of its request (``GenerationRequest.caller_id``) stops."""

    async def end(self, request_id: str, event: JobEvent) -> None:
        """Append a terminal event to a request that no worker has started (a cancelled queued job:
        its caller's stream ends now, not when a worker reaches the job and skips it)."""

    async def read_events(self, request_id: str) -> list[tuple[str, JobEvent]]:
        """Every event of a request so far, without waiting."""
        ...

    async def last_event(self, request_id: str) -> tuple[int, JobEvent | None]:
        """How many events a request's stream holds, and its last one (None: none), without
        reading the others."""
        ...

    async def set_aside(self, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        """Record a poison request in the pool's dead-letter stream (every worker that ran it died)."""


class RequestLog(Protocol):
    """The record of a caller's request: its attempts (one per failover) and its re-attaches."""

    async def begin(self, caller_id: str, attempt: Attempt, first: bool) -> bool:
        """Record an attempt of the caller's request. ``first``: only if the request has none yet;
        False when it has (a retry of a request already accepted: attach to it instead)."""
        ...

    async def forget(self, caller_id: str) -> None:
        """Drop the attempts record of a request that could not be queued after all."""

    async def attempts(self, caller_id: str) -> list[Attempt]:
        """The request's attempts, in order (empty: unknown or expired)."""
        ...

    async def attach(self, caller_id: str) -> int:
        """Count a re-attach of the caller; returns the new count."""
        ...

    async def attach_count(self, caller_id: str) -> int: ...

    async def reading(self, caller_id: str, delta: int) -> int:
        """Count a reader of the caller's resumable request coming (``delta`` 1) or going (-1), as
        any gateway sees them; returns how many read it now (``delta`` 0: only that)."""
        ...


class AdapterRegistry(Protocol):
    """The LoRA adapters loaded into each pool at run time (AdminService), besides each worker's own
    LLAMAMESH_WORKER_ADAPTERS."""

    async def adapters(self, pool: str) -> dict[str, str]:
        """name -> path of the pool's run-time adapters."""
        ...

    async def set_adapter(self, pool: str, name: str, path: str) -> None: ...

    async def drop_adapter(self, pool: str, name: str) -> None: ...


@dataclass(frozen=True)
class QueueDepth:
    """A pool's interactive jobs now, over all its tenants' work streams."""

    waiting: int  # queued, not leased by any worker yet
    leased: int  # leased by a worker (running, or about to), not yet acked


class Registry(Protocol):
    """The workers of each pool, as their heartbeats say, and the work waiting for them."""

    async def workers(self, pool: str) -> list[WorkerStatus]:
        """The live workers of a pool: those whose last heartbeat has not expired."""
        ...

    async def queue_depth(self, pool: str) -> QueueDepth:
        """The pool's jobs waiting unleased and leased, summed over its tenants' work streams (batch
        items not included). Raises QueueUnavailable."""
        ...


class QueueState(Protocol):
    """Whether the queue answers, and whether it still holds its data."""

    async def ping(self) -> None:
        """Raise QueueUnavailable unless the queue answers."""

    async def epoch(self) -> str:
        """The identity of the queue's data, set by the first caller and kept: a different one later
        means Redis came back without its data. Raises QueueUnavailable."""
        ...

    async def check_writes(self) -> None:
        """Raise QueueOutOfMemory while Redis refuses writes for want of memory (at its maxmemory),
        QueueUnavailable while it refuses them otherwise (a read-only replica) or does not answer."""

    async def preflight(self) -> None:
        """Raise QueueRefused, naming what, when Redis answers but refuses this client what the queue needs (its
        password, its database, scripts, XAUTOCLAIM); QueueUnavailable while it does not answer."""

    async def eviction(self) -> str:
        """What Redis would evict at its maxmemory ("allkeys-lru", ...: a queue loses jobs, events and results
        then), or "" when it evicts nothing (noeviction, or no maxmemory) or does not say. Raises
        QueueUnavailable."""
        ...

    async def close(self) -> None: ...


class RelayQueue(Jobs, RequestLog, Protocol):
    """What the gateway's relay (services/relay.py) needs."""


class ProbeQueue(Jobs, Registry, Protocol):
    """What the gateway's view of its pools (services/backends.py) needs: heartbeats and probes."""


class JobQueue(Jobs, RequestLog, Registry, QueueState, AdapterRegistry, Protocol):
    """The gateway's whole side of the queue (``streams.RedisQueue``, ``memory.MemoryQueue``)."""


class WorkQueue(AdapterRegistry, Protocol):
    """A worker's side: lease jobs from a pool, publish their events, ack them."""

    async def epoch(self) -> str:
        """As ``QueueState.epoch``: a worker whose jobs' data Redis lost sees it change."""
        ...

    async def queued(self, pool: str, request_id: str) -> bool:
        """As ``Jobs.queued``: which of its jobs were queued to the data Redis holds now."""
        ...

    async def preflight(self) -> None:
        """As ``QueueState.preflight``: a worker refused what the queue needs stops, saying why."""

    async def join(self, pool: str) -> None:
        """Create the pool's work stream and consumer group if missing."""

    async def lease(
        self, pool: str, consumer: str, count: int, block_ms: int, exclude: Collection[str] = ()
    ) -> list[Lease]:
        """Take up to ``count`` new jobs, waiting at most ``block_ms`` for the first (0: not at all);
        shared between the tenants with jobs waiting by their weights (fair share), none of the
        tenants in ``exclude`` (as ``Lease.tenant`` names them). With prefix affinity on
        (docs/affinity.md): from the partitions this consumer owns first, others' (``stolen``) only
        when it has nothing of its own and they waited ``affinity_steal_after_ms``."""
        ...

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
        """Take over up to ``count`` jobs leased and left untouched for ``min_idle_ms``, from all of
        the pool's work streams: their worker died, or this consumer's own ones that it does not run
        (``running``: the ``Lease.ref`` of those it does), e.g. a lease whose reply was lost, or an
        ack Redis lost with its last second of writes. ``own``: all of this consumer's own leased
        jobs (a restart under the same name), any idle time. Each job is claimed by one caller only.
        A job delivered more than ``max_deliveries`` times is not returned: it goes to the
        dead-letter stream and its caller gets a failure. A job that had begun (events written)
        comes with ``started`` set."""
        ...

    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> list[str]:
        """Say this worker is alive (with its figures) for the next ``ttl_s`` seconds, and reset
        the idle time of the jobs it runs (``touch``: their ``Lease.ref``) so nobody reclaims them.
        Returns those of ``touch`` another worker took over meanwhile (this one could not touch them
        for the claim idle time: paused, or cut off from Redis): the worker must stop them, for the
        other one runs them now. With prefix affinity on, a ready worker's heartbeat also renews and
        rebalances its share of the pool's partitions for ``ttl_s`` (any other state gives its share
        up)."""
        ...

    async def leave(self, pool: str, worker: str) -> None:
        """Withdraw this worker's heartbeat (a clean stop)."""

    async def publish(self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]) -> set[str]:
        """Write events in one round trip, in order.

        A terminal event also expires the event stream and acks the lease. Returns
        the ids among ``watch`` (requests in flight) that are cancelled.
        """
        ...

    async def close(self) -> None: ...


class BatchStore(Protocol):
    """Durable batches: the gateway's side (create, get, owned, cancel, results) and the worker's
    (join, lease_items, reclaim, touch, record, discard). ``batches.RedisBatches`` on Redis;
    ``memory.MemoryBatches`` in memory."""

    async def create(
        self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]
    ) -> tuple[BatchInfo, bool]:
        """Store the batch and queue its ``(pool, request)`` items; (the batch, whether it is new).
        The same id with the same fingerprint returns the stored one; with another, InvalidRequest."""
        ...

    async def get(self, batch_id: str) -> BatchInfo | None:
        """The batch if it was accepted (stored whole, every item queued); None otherwise."""
        ...

    async def stored(self, batch_id: str) -> bool:
        """Whether anything of the batch is stored: accepted, or its submission cut off (for a retry to finish
        or the sweep to drop)."""
        ...

    async def data_since(self) -> float:
        """When (Unix s) the queue's data began: the first gateway's start, or Redis's coming back
        without its data (0: not known). Raises QueueUnavailable."""
        ...

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        """The owner's batches created before ``before`` (None: all), newest first."""
        ...

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        """Cancel an unfinished batch (queued items end cancelled, running ones finish)."""
        ...

    async def settle(self, batch_id: str) -> BatchInfo | None:
        """End the unstarted items that can no longer start (cancelling or failed batch: cancelled;
        past the deadline: expired); idempotent."""
        ...

    async def sweep(self, limit: int = 100) -> int:
        """Settle open batches past their deadline; how many were looked at."""
        ...

    async def open_batches(self, limit: int = 1000) -> list[BatchInfo]:
        """Up to ``limit`` batches not yet ended (their deadline or results due first)."""
        ...

    async def results(self, batch_id: str, after: str, block_ms: int | None) -> list[tuple[str, ItemResult]]:
        """(cursor, result) after cursor ``after`` ("0-0": the first), waiting up to ``block_ms``."""
        ...

    async def join(self, pool: str) -> None: ...

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        """New batch items, the batch whose deadline comes first first, each prefix group's from the
        consumer that leased its start; ``cancelled`` / ``expired`` set on those that must not run."""
        ...

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        """Items another consumer leased and left untouched for ``min_idle_ms``."""
        ...

    async def touch(self, pool: str, consumer: str, refs: Sequence[str]) -> list[str]:
        """Keep the items ``consumer`` runs (``Lease.item_ref`` each) from being reclaimed; returns
        those another consumer took over meanwhile (the worker stops them)."""
        ...

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        """The item's one result (False if it had one), then ack the item."""
        ...

    async def discard(self, lease: Lease) -> None:
        """Ack and drop an item without a result (a second copy of one that is running)."""
