"""In-memory fake of the queue with the same contract as ``streams.RedisQueue``.

For unit and in-process tests of one layer; never the only proof of anything. Fair share is
simpler here: a FIFO per tenant, leased in plain round robin (one job per tenant with work per
turn), weights kept but unused (``weights``); Redis does weighted deficit round robin.

Prefix affinity (``partitions`` > 0) as on Redis (llamamesh/queue/affinity.py): each job has its
partition, a ready worker's heartbeat takes its share of the partitions (``affinity.assign``), a
lease takes from the worker's own partitions first, then the oldest of the others' (a steal), and
waits on its own for at most ``steal_after_ms`` at a time. No reclaim here (one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from llamamesh.errors import AlreadyExists, QueueFull, QueueOutOfMemory, QueueUnavailable
from llamamesh.queue.affinity import assign, partition_of
from llamamesh.queue.keys import CANCEL_AHEAD_TTL_S, stream_tenant
from llamamesh.queue.protocol import Lease, QueueDepth, batch_at_risk
from llamamesh.types import (
    Attempt,
    BatchInfo,
    BatchState,
    GenerationRequest,
    ItemResult,
    ItemStatus,
    JobEvent,
    WorkerStatus,
    public_id,
)


@dataclass
class _Pool:
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
        return sorted((e for q in self.tenants.values() for e in q), key=lambda e: _seq(e[0]))

    def take(
        self, count: int, exclude: Collection[str] = (), partitions: Collection[int] | None = None,
        queued_before: float | None = None,
    ) -> list[tuple[str, GenerationRequest]]:  # fmt: skip
        """Up to ``count`` jobs, one per tenant with work per turn (round robin), none of ``exclude``;
        only of ``partitions`` when given (each tenant's oldest job there), queued before
        ``queued_before`` (monotonic s) when given."""
        taken: list[tuple[str, GenerationRequest]] = []
        while len(taken) < count:
            heads = {t: i for t, q in self.tenants.items() if t not in exclude
                     if (i := self._head(q, partitions, queued_before)) is not None}  # fmt: skip
            ready = sorted(heads)
            if not ready:
                break
            tenant = next((t for t in ready if self.last is None or t > self.last), ready[0])
            taken.append(self.tenants[tenant].pop(heads[tenant]))
            self.last = tenant
        return taken

    def _head_any(self, partitions: Collection[int], exclude: Collection[str]) -> bool:
        """Whether a job of ``partitions`` waits (of a tenant not in ``exclude``)."""
        return any(self._head(q, partitions) is not None for t, q in self.tenants.items() if t not in exclude)

    def _head(
        self, queue: list[tuple[str, GenerationRequest]], partitions: Collection[int] | None,
        queued_before: float | None = None,
    ) -> int | None:  # fmt: skip
        if partitions is None:
            return 0 if queue else None
        for i, (eid, _r) in enumerate(queue):
            if queued_before is not None and self.born.get(eid, 0.0) > queued_before:
                return None  # the rest came later still
            if self.part.get(eid) in partitions:
                return i
        return None


class MemoryQueue:
    """JobQueue and WorkQueue in one process. ``down = True`` makes every call fail."""

    def __init__(self, partitions: int = 0, steal_after_ms: int = 50) -> None:
        self._parts = partitions
        self._steal_after_ms = steal_after_ms
        self._pools: dict[str, _Pool] = {}
        self._events: dict[str, list[tuple[str, JobEvent]]] = {}
        self._cancelled: set[str] = set()
        # caller id -> ("a": ahead of its Generate, until the deadline; "1": while its request lives)
        self._called_off: dict[str, tuple[str, float]] = {}
        self._epoch = uuid.uuid4().hex
        self.dead: list[tuple[str, GenerationRequest, str, int]] = []
        self._attempts: dict[str, list[Attempt]] = {}
        self._adapters: dict[str, dict[str, str]] = {}  # pool -> run-time LoRA adapters
        self._attaches: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        # pool -> worker -> (monotonic expiry, status)
        self._beats: dict[str, dict[str, tuple[float, WorkerStatus]]] = {}
        # pool -> tenant -> the weight its latest submission gave (inspection only)
        self.weights: dict[str, dict[str, float]] = {}
        self.down = False
        self.full = False

    def _check(self) -> None:
        if self.down:
            raise QueueUnavailable("the queue is unreachable")

    def _pool(self, pool: str) -> _Pool:
        return self._pools.setdefault(pool, _Pool())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- inspection for tests ----------------------------------------------
    def pending(self, pool: str) -> dict[str, tuple[str, GenerationRequest]]:
        return dict(self._pool(pool).pending)

    def waiting(self, pool: str) -> list[GenerationRequest]:
        return [r for _i, r in self._pool(pool).queued()]

    def events_of(self, request_id: str) -> list[JobEvent]:
        return [e for _i, e in self._events.get(request_id, [])]

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    # ---- gateway side -------------------------------------------------------
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
        entry_id = f"{next(self._ids)}-0"
        if self._parts:
            self._pool(pool).part[entry_id] = partition_of(request, self._parts)
            self._pool(pool).born[entry_id] = time.monotonic()
        waiting.append((entry_id, request))
        await self._notify()

    async def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        async for item in self.events_within(request_id, None, after):
            if item is not None:
                yield item

    async def events_within(
        self, request_id: str, idle_s: float | None, after: str = "0-0"
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        loop = asyncio.get_running_loop()
        seen = _seq(after)
        idle_at = loop.time() + (idle_s or 0.0)  # idle: none of this request's events since then
        while True:
            self._check()
            fresh = [(i, e) for i, e in self._events.get(request_id, []) if _seq(i) > seen]
            for entry_id, event in _merged(fresh):
                seen = _seq(entry_id)
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

    async def cancel(self, request_id: str) -> None:
        self._check()
        self._cancelled.add(request_id)
        await self._notify()

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

    async def end(self, request_id: str, event: JobEvent) -> None:
        self._check()
        self._events.setdefault(request_id, []).append((f"{next(self._ids)}-0", event))
        await self._notify()

    async def read_events(self, request_id: str) -> list[tuple[str, JobEvent]]:
        self._check()
        return list(self._events.get(request_id, ()))

    async def set_aside(self, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        self._check()
        self.dead.append((pool, request, reason, deliveries))

    async def epoch(self) -> str:
        self._check()
        return self._epoch

    def lose_data(self) -> None:
        """Tests: what a Redis that came back empty looks like (a new epoch)."""
        self._epoch = uuid.uuid4().hex

    async def call_off(self, caller_id: str) -> None:
        self._check()
        ahead = caller_id not in self._attempts
        self._called_off[caller_id] = ("a", time.monotonic() + CANCEL_AHEAD_TTL_S) if ahead else ("1", float("inf"))
        await self._notify()

    async def ping(self) -> None:
        self._check()

    async def check_writes(self) -> None:
        self._check_write()

    def _check_write(self) -> None:
        """Tests: ``full`` is a Redis at its maxmemory (reads answer, writes are refused)."""
        self._check()
        if self.full:
            raise QueueOutOfMemory("Redis is full", retry_after_s=5.0)

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

    async def close(self) -> None:
        return None

    # ---- worker side --------------------------------------------------------
    async def join(self, pool: str) -> None:
        self._check()
        self._pool(pool)

    async def lease(
        self, pool: str, consumer: str, count: int, block_ms: int, exclude: Collection[str] = ()
    ) -> list[Lease]:
        self._check()
        p = self._pool(pool)
        left_out = {stream_tenant(t) for t in exclude}
        if self._parts:
            return await self._lease_parts(pool, consumer, count, block_ms, left_out)

        def waiting() -> bool:
            return any(q for t, q in p.tenants.items() if t not in left_out)

        if not waiting():
            if block_ms <= 0:
                return []
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(waiting), block_ms / 1000)
                except asyncio.TimeoutError:
                    return []
        taken = p.take(count, left_out)
        for entry_id, req in taken:
            p.pending[entry_id] = (consumer, req)
        return [Lease(pool=pool, entry_id=i, request=r, cancelled=self._is_cancelled(r),
                      tenant=stream_tenant(r.tenant)) for i, r in taken]  # fmt: skip

    async def _lease_parts(
        self, pool: str, consumer: str, count: int, block_ms: int, left_out: set[str]
    ) -> list[Lease]:
        """Affinity on: own partitions first, then a steal, waiting on its own ``steal_after_ms`` at
        a time until ``block_ms`` is over."""
        p = self._pool(pool)
        deadline = time.monotonic() + block_ms / 1000
        while True:
            owned = set(self.owned(pool, consumer))
            others = set(range(self._parts)) - owned
            stolen = False
            taken = p.take(count, left_out, owned) if owned else []
            if not taken and others:  # a steal: only jobs that waited steal_after_ms
                steal_before = time.monotonic() - self._steal_after_ms / 1000
                taken, stolen = p.take(count, left_out, others, steal_before), True
            left = deadline - time.monotonic()
            if taken or block_ms <= 0 or left <= 0:
                break
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait_for(functools.partial(p._head_any, owned, left_out)),
                        min(left, self._steal_after_ms / 1000),
                    )
        for entry_id, req in taken:
            p.pending[entry_id] = (consumer, req)
        return [Lease(pool=pool, entry_id=i, request=r, cancelled=self._is_cancelled(r), tenant=stream_tenant(r.tenant),
                      partition=p.part.get(i), stolen=stolen) for i, r in taken]  # fmt: skip

    def owned(self, pool: str, worker: str) -> list[int]:
        """The partitions the worker owns now (affinity on; an owner's lease may have expired)."""
        return sorted(k for k, (w, _u) in self._pool(pool).owners.items() if w == worker)

    async def reclaim(
        self, pool: str, consumer: str, min_idle_ms: int, count: int, max_deliveries: int, own: bool = False,
        running: Collection[str] = (),
    ) -> list[Lease]:  # fmt: skip
        self._check()
        return []  # one process: no worker dies apart from it

    async def adapters(self, pool: str) -> dict[str, str]:
        self._check()
        return dict(self._adapters.get(pool, {}))

    async def set_adapter(self, pool: str, name: str, path: str) -> None:
        self._check()
        self._adapters.setdefault(pool, {})[name] = path

    async def drop_adapter(self, pool: str, name: str) -> None:
        self._check()
        self._adapters.get(pool, {}).pop(name, None)

    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> None:
        self._check()
        self._beats.setdefault(status.pool, {})[status.worker] = (time.monotonic() + ttl_s, status)
        if self._parts:
            p = self._pool(status.pool)
            if status.ready:
                now_ms = int(time.monotonic() * 1000)
                p.owners, p.members, _mine = assign(p.owners, p.members, status.worker, now_ms, int(ttl_s * 1000),
                                                    self._parts)  # fmt: skip
            else:
                self._release(p, status.worker)

    async def leave(self, pool: str, worker: str) -> None:
        self._check()
        self._beats.get(pool, {}).pop(worker, None)
        self._release(self._pool(pool), worker)

    @staticmethod
    def _release(p: _Pool, worker: str) -> None:
        p.members.pop(worker, None)
        p.owners = {k: o for k, o in p.owners.items() if o[0] != worker}

    async def publish(
        self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]
    ) -> set[str]:
        self._check()
        for lease, event in events:
            self._events.setdefault(lease.request.request_id, []).append((f"{next(self._ids)}-0", event))
            if event.terminal:
                self._pool(lease.pool).pending.pop(lease.entry_id, None)
                self._pool(lease.pool).part.pop(lease.entry_id, None)
                self._pool(lease.pool).born.pop(lease.entry_id, None)
        await self._notify()
        return {r.request_id for r in watch if self._is_cancelled(r)}

    def _is_cancelled(self, req: GenerationRequest) -> bool:
        off = self._called_off.get(req.caller_id)
        return req.request_id in self._cancelled or (off is not None and off[1] > time.monotonic())


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


def _seq(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Batch:
    info: BatchInfo
    fingerprint: str
    done: dict[str, str] = field(default_factory=dict)
    results: list[tuple[str, ItemResult]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    started: set[str] = field(default_factory=set)
    closing: bool = False


class MemoryBatches:
    """BatchStore in one process, same contract as ``batches.RedisBatches`` (no reclaim: nothing
    here dies separately)."""

    def __init__(self, fail_after: int = 0) -> None:
        self.fail_after = fail_after
        self.since = time.time()
        self._batches: dict[str, _Batch] = {}
        self._items: dict[str, _Pool] = {}
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, ready: Callable[[], bool], block_ms: int | None) -> None:
        if not ready() and block_ms:
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(ready), block_ms / 1000)

    async def create(
        self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]
    ) -> tuple[BatchInfo, bool]:
        have = self._batches.get(info.batch_id)
        if have is not None:
            if have.fingerprint != fingerprint:
                raise AlreadyExists(
                    f"batch id {public_id(info.batch_id)!r} names another batch (other items); "
                    "resubmit it unchanged, or use a new id"
                )
            return have.info, False
        now = time.time()
        times = {BatchState.VALIDATING.value: info.created_at, BatchState.IN_PROGRESS.value: now}
        stored = dataclasses.replace(info, state=BatchState.IN_PROGRESS, times=MappingProxyType(times))
        self._batches[info.batch_id] = _Batch(stored, fingerprint, ids=[req.custom_id for _p, req in items])
        for pool, req in items:
            self._items.setdefault(pool, _Pool()).waiting.append((f"{next(self._ids)}-0", req))
        await self._notify()
        return stored, True

    async def get(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        return b.info if b is not None else None

    async def data_since(self) -> float:
        return self.since

    def lose_data(self) -> None:
        """Tests: what a Redis that came back empty looks like (every batch gone)."""
        self._batches.clear()
        self.since = time.time()

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        mine = [b.info for b in self._batches.values() if b.info.owner == owner]
        mine = [i for i in mine if before is None or i.created_at < before]
        return sorted(mine, key=lambda i: -i.created_at)[:limit]

    def _set(self, b: _Batch, **changes: object) -> None:
        b.info = dataclasses.replace(b.info, **changes)  # type: ignore[arg-type]

    def _enter(self, b: _Batch, state: BatchState, **changes: object) -> None:
        self._set(b, state=state, times=MappingProxyType({**b.info.times, state.value: time.time()}), **changes)

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        if b is None:
            return None
        if b.info.state in (BatchState.VALIDATING, BatchState.IN_PROGRESS, BatchState.CANCELLING):
            if b.info.state is not BatchState.CANCELLING:
                self._enter(b, BatchState.CANCELLING)
            await self.settle(batch_id)
        return b.info

    async def settle(self, batch_id: str) -> BatchInfo | None:
        b = self._batches.get(batch_id)
        if b is None or (b.info.state.ended and b.info.state is not BatchState.FAILED):
            return b.info if b else None
        if b.info.state is BatchState.IN_PROGRESS:
            if time.time() <= b.info.expires_at:
                return b.info
            b.closing = True
            status = ItemStatus.EXPIRED
        else:
            status = ItemStatus.CANCELLED
        for cid in b.ids:
            if cid not in b.started and cid not in b.done:
                self._add(b, ItemResult.unrun(cid, status, f"the batch ended ({b.info.state.value}) before it started"))
        self._finish(b)
        await self._notify()
        return b.info

    async def sweep(self, limit: int = 100) -> int:
        due = [b for b in self._batches.values() if not b.info.state.ended and time.time() > b.info.expires_at]
        for b in due[:limit]:
            await self.settle(b.info.batch_id)
        return len(due[:limit])

    async def at_risk(self, fraction: float, limit: int = 1000) -> int:
        now = time.time()
        infos = [b.info for b in self._batches.values() if not b.info.state.ended][:limit]
        return sum(1 for i in infos if batch_at_risk(i, now, fraction))

    async def results(self, batch_id: str, after: str, block_ms: int | None) -> list[tuple[str, ItemResult]]:
        b = self._batches.get(batch_id)
        if b is None:
            return []

        def newer() -> list[tuple[str, ItemResult]]:
            return [(c, r) for c, r in b.results if int(c.split("-")[0]) > int(after.split("-")[0])]

        await self._wait(lambda: bool(newer()), block_ms)
        return newer()

    async def join(self, pool: str) -> None:
        self._items.setdefault(pool, _Pool())

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        p = self._items.setdefault(pool, _Pool())
        await self._wait(lambda: bool(p.waiting), block_ms)
        taken, p.waiting = p.waiting[:count], p.waiting[count:]
        out = []
        for entry_id, req in taken:
            p.pending[entry_id] = (consumer, req)
            b = self._batches.get(req.batch_id)
            late = b is not None and (b.closing or time.time() > b.info.expires_at)
            gone = b is None or b.info.state is not BatchState.IN_PROGRESS
            if b is not None and not gone and not late:
                b.started.add(req.custom_id)
            out.append(Lease(pool=pool, entry_id=entry_id, request=req, cancelled=gone, expired=late and not gone))
        return out

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        return []

    async def touch(self, pool: str, consumer: str, entry_ids: Sequence[str]) -> None:
        return None

    async def discard(self, lease: Lease) -> None:
        self._items.setdefault(lease.pool, _Pool()).pending.pop(lease.entry_id, None)

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        req = lease.request
        b = self._batches.get(req.batch_id)
        await self.discard(lease)
        if b is None or req.custom_id in b.done:
            return False
        self._add(b, result)
        i = b.info
        if (self.fail_after and i.state is BatchState.IN_PROGRESS and i.succeeded == 0
                and i.errored >= self.fail_after):  # fmt: skip
            self._enter(b, BatchState.FAILED)
            await self.settle(req.batch_id)
        self._finish(b)
        await self._notify()
        return True

    def _add(self, b: _Batch, result: ItemResult) -> None:
        b.done[result.custom_id] = result.status.value
        b.results.append((f"{next(self._ids)}-0", result))
        self._set(b, **{result.status.value: getattr(b.info, result.status.value) + 1})

    def _finish(self, b: _Batch) -> None:
        i = b.info
        if i.processing or i.state not in (BatchState.IN_PROGRESS, BatchState.CANCELLING, BatchState.FAILED):
            return
        now = time.time()
        if i.state is not BatchState.FAILED and not i.results_expire_at:
            final = (BatchState.CANCELLED if i.state is BatchState.CANCELLING
                     else BatchState.EXPIRED if i.expired else BatchState.COMPLETED)  # fmt: skip
            self._set(b, state=final, times=MappingProxyType({**i.times, BatchState.FINALIZING.value: now,
                                                              final.value: now}))  # fmt: skip
        if not b.info.results_expire_at:
            self._set(b, results_expire_at=now)
