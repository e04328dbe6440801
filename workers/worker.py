"""The worker process: leases jobs of one pool, runs them on one engine, publishes events.

Ownership: the worker owns its job tasks (a set it cancels and awaits on
shutdown), the outbox's flusher task, its heartbeat and its engine watchdog. It admits from the
stream by free slots (``max_inflight`` minus jobs in flight), so the engine always has work
when there is work.

Life: the heartbeat starts as soon as Redis answers, before the engine is ready, with state
``starting`` and what the engine's start is doing (converting, loading, compiling); gateways
treat the pool as coming up. Then ``ready`` (leasing), or ``failed`` with the reason when the
engine cannot start (kept visible for a minute, then the process exits non-zero). A start step
that blocks the event loop (imports, vLLM's engine start) is announced with a heartbeat that
lives ``start_timeout_s``, since no refresh can run meanwhile; while the loop runs the heartbeat
is refreshed every ``heartbeat_s`` with the short TTL, so a worker that dies is gone within it.

The watchdog asks the engine ``check_health()`` every ``health_check_s`` and watches its progress
counter: a dead engine stops the worker (drain, exit 1); a wedged one (requests in flight, no
progress for ``wedge_timeout_s``) makes it withdraw its heartbeat at once, so that gateways fail
its streams over, and exit 1 without waiting on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import Any

import structlog

from llamamesh import metrics
from llamamesh.backoff import Delays
from llamamesh.errors import (
    EngineDead,
    FailedPrecondition,
    InvalidRequest,
    LlamameshError,
    PermissionDenied,
    QueueUnavailable,
    WorkerDied,
    WorkerLost,
)
from llamamesh.loop import serving_heap
from llamamesh.queue.protocol import BatchStore, Lease, WorkQueue
from llamamesh.settings import BatchSettings, WorkerSettings, adapter_table
from llamamesh.types import JobEvent, WorkerState, WorkerStatus
from workers.batch import record, run_batch_item, skipped_result
from workers.engines.base import Engine
from workers.job import cancelled_event, failure_of, run_job
from workers.outbox import Outbox
from workers.samples import Samples

log = structlog.get_logger(__name__)

# How long a worker that could not start stays visible as ``failed`` (with its reason) after it exits.
FAILED_TTL_S = 60.0


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        queue: WorkQueue,
        engine: Engine,
        block_ms: int = 2000,
        batches: BatchStore | None = None,
        batch: BatchSettings | None = None,
        freeze: bool = False,
    ) -> None:
        """``freeze``: once the engine is ready, freeze the process's heap (llamamesh/loop.py:
        serving_heap; the worker process does, in-process tests do not)."""
        self._s = settings
        self._freeze = freeze
        self._queue = queue
        self._engine = engine
        self._samples = Samples(engine)  # generation jobs go through it (GenerateRequest.n)
        # LoRA adapters: the engine's own (LLAMAMESH_WORKER_ADAPTERS), those loaded from the pool's
        # run-time list (name -> path), and the run-time ones that failed ((name, path) -> why).
        self._own_adapters = frozenset(adapter_table(settings.adapters))
        self._loaded_at_runtime: dict[str, str] = {}
        self._adapter_errors: dict[tuple[str, str], str] = {}
        self._adapter_sync: asyncio.Task[None] | None = None
        self._block_ms = block_ms
        self._batches = batches
        self._b = batch or BatchSettings()
        # Batch items running here (request id -> lease): touched every heartbeat so that nobody
        # takes them over while this worker lives.
        self._batch_running: dict[str, Lease] = {}
        # Interactive jobs running here: touched every heartbeat as well.
        self._running: dict[str, Lease] = {}
        # Set when the drain's grace ran out: the jobs it aborts end worker_lost (handed back).
        self._handing_back = asyncio.Event()
        self._last_reclaim = 0.0
        self._last_job_reclaim = time.monotonic()
        self.name = settings.consumer_name()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slot_free = asyncio.Event()
        # Only the tenant headroom was free at the last lease (workers/worker.py::_interactive).
        self._polling = False
        self._outbox = Outbox(queue, on_cancel=self._cancel, on_fail=self._outbox_failed)
        self.engine_died: EngineDead | None = None
        self._writer_failed = asyncio.Event()
        self.ready = asyncio.Event()
        self.join_failures = 0
        self.state = WorkerState.STARTING
        self._detail = ""
        self._steps_counted = 0  # of the engine's step counter, added to llamamesh_engine_steps_total
        self._since = time.time()
        # Set by the watchdog: the engine stopped making progress; the worker leaves without draining.
        self.wedged = False

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    async def _cancel(self, request_id: str) -> None:
        log.info("job_cancel_requested", request_id=request_id)
        await self._samples.abort(request_id)

    def _outbox_failed(self, exc: BaseException) -> None:
        """The event writer stopped on an unexpected error: no stream of this worker can move on. Leave
        at once, as for a wedged engine (heartbeat withdrawn: the gateways fail its streams over; the
        jobs stay unacked for others to take), and exit non-zero."""
        why = f"the worker could not publish its events: {exc!r}"
        self.engine_died, self.wedged = EngineDead(why), True
        self._set_state(WorkerState.FAILED, why)
        self._slot_free.set()  # wake the lease loop
        self._writer_failed.set()  # and a drain in progress

    def _start(self, lease: Lease) -> None:
        rid = lease.request.request_id
        if lease.request.batch_id and self._batches is not None:
            job: Coroutine[Any, Any, None] = run_batch_item(lease, self._samples, self._batches)
            self._batch_running[rid] = lease
        else:
            job = run_job(lease, self._samples, self._outbox, self.name, self._handing_back)
            self._running[rid] = lease
        task = asyncio.create_task(job, name=f"job-{rid}")
        self._tasks[rid] = task
        task.add_done_callback(lambda t, rid=rid: self._done(rid, t))  # type: ignore[misc]

    def _done(self, rid: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(rid, None)
        self._batch_running.pop(rid, None)
        self._running.pop(rid, None)
        self._slot_free.set()
        if not task.cancelled() and isinstance(task.exception(), EngineDead):
            self.engine_died = task.exception()  # type: ignore[assignment]

    async def run(self, stop: asyncio.Event) -> None:
        """Start the engine (heartbeats say ``starting`` meanwhile), then lease and run jobs until
        ``stop`` is set or the engine dies, then drain.

        Raises EngineDead (after draining) if the engine could not start, died or wedged, or the event
        writer failed (workers/outbox.py), so the process exits non-zero.
        """
        delays = Delays(first_s=0.1, cap_s=2.0)
        while True:  # Redis may come up after the worker: wait for it rather than exit
            try:
                await self._queue.join(self._s.pool)
                if self._batches is not None:
                    await self._batches.join(self._s.pool)
                break
            except QueueUnavailable:
                self.join_failures += 1
                log.warning("join_failed", pool=self._s.pool, retry_in_s=round(await delays.wait(stop), 3))
                if stop.is_set():
                    return
        self._outbox.start()
        beat_stop = asyncio.Event()
        beat = asyncio.create_task(self._heartbeat(beat_stop), name="heartbeat")
        watchdog: asyncio.Task[None] | None = None
        try:
            if await self._start_engine(stop):
                watchdog = await self._become_ready(stop)
                if self._freeze:
                    log.info("heap_frozen", objects=serving_heap())
                await self._lease_loop(stop)
        finally:
            if watchdog is not None:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            if not self.wedged:
                # Heartbeats go on while draining: the gateways must not take its streams for lost. The
                # drain is cut short if the event writer fails meanwhile (then wedged).
                await self._drain()
            beat_stop.set()
            await asyncio.gather(beat, return_exceptions=True)
            with contextlib.suppress(QueueUnavailable):
                if self.wedged or self.state is not WorkerState.FAILED:
                    await self._queue.leave(self._s.pool, self.name)
                else:  # say why for a while after it is gone
                    await self._queue.heartbeat(self.status(), FAILED_TTL_S)
            if self.wedged:  # gateways fail its streams over now, not after a drain that cannot end
                await self._abandon()
        if self.engine_died is not None:
            raise self.engine_died

    async def _become_ready(self, stop: asyncio.Event) -> asyncio.Task[None]:
        """Take this consumer's own leased jobs first (a restart under the same name), say ready, and
        start the engine watchdog (returned: run() owns it)."""
        with contextlib.suppress(QueueUnavailable):  # a restart under the same name: its own jobs first
            s = self._s
            for lease in await self._queue.reclaim(s.pool, self.name, 0, s.max_inflight, s.max_deliveries,
                                                   own=True):  # fmt: skip
                await self._admit(lease)
        self._set_state(WorkerState.READY)
        self.ready.set()
        log.info("worker_started", pool=self._s.pool, worker=self.name, max_inflight=self._s.max_inflight)
        return asyncio.create_task(self._watch_engine(stop), name="engine-watchdog")

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        """Lease by free slots until ``stop`` or the engine's death."""
        delays = Delays(first_s=0.1)
        while not stop.is_set() and self.engine_died is None:
            free = self._s.max_inflight - len(self._tasks)
            if free <= 0:
                self._slot_free.clear()
                await _wait_any(self._slot_free, stop)
                continue
            self._slot_free.clear()
            try:
                leases = await self._lease(free)
                delays.reset()
            except QueueUnavailable:
                # Redis is out: no worker could touch its jobs meanwhile, so reclaim none until a
                # round of heartbeats has touched them again after it is back.
                self._last_job_reclaim = self._last_reclaim = time.monotonic()
                log.warning("lease_failed", retry_in_s=round(await delays.wait(stop), 3))
                continue
            if self.engine_died is not None and leases:
                await self._hand_back(leases)  # its engine died while it was waiting for them
                break
            for lease in leases:
                await self._admit(lease)
            if not leases and self._polling:  # only the headroom is free: look again soon
                await _wait_any(self._slot_free, stop, timeout=self._s.headroom_poll_s)

    async def _hand_back(self, leases: list[Lease]) -> None:
        """Jobs leased after the engine died, never started: each ends ``worker_lost`` (not a death:
        nothing ran), so the gateway sends it to another worker at once."""
        lost = WorkerLost(f"worker {self.name!r} lost its engine before it started the job")
        for lease in leases:
            if lease.request.batch_id:
                continue  # left leased: another worker reclaims it once idle (claim_idle_s)
            await self._outbox.finish(lease, JobEvent(worker=self.name, failed=failure_of(lost)))
        log.warning("jobs_handed_back", count=len(leases), reason="engine_died")

    def _set_state(self, state: WorkerState, detail: str = "") -> None:
        self.state, self._detail, self._since = state, detail, time.time()

    async def _start_engine(self, stop: asyncio.Event) -> bool:
        """Start the engine with heartbeats saying so; True once it is ready. False if ``stop`` came
        first, or the start failed or timed out (state FAILED, ``engine_died`` set)."""
        s = self._s
        # vLLM's and TensorRT-LLM's starts block the event loop: this heartbeat must outlive them.
        with contextlib.suppress(QueueUnavailable):
            await self._queue.heartbeat(self.status(), max(s.start_timeout_s, s.heartbeat_ttl_s))
        t0 = time.monotonic()
        log.info("engine_starting", engine=s.engine, model=s.model)
        start = asyncio.ensure_future(asyncio.wait_for(self._engine.start(), s.start_timeout_s))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({start, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                start.cancel()
                await asyncio.gather(start, return_exceptions=True)
                return False
            start.result()
        except asyncio.TimeoutError:
            self._fail(f"the {s.engine} engine did not start within {s.start_timeout_s:g} s")
            return False
        except (EngineDead, InvalidRequest) as exc:
            self._fail(exc.message)
            return False
        finally:
            stopping.cancel()
        log.info("engine_started", engine=s.engine, start_s=round(time.monotonic() - t0, 2))
        return True

    def _fail(self, why: str) -> None:
        log.error("engine_start_failed", engine=self._s.engine, error=why)
        self._set_state(WorkerState.FAILED, why)
        self.engine_died = EngineDead(why)

    async def _watch_engine(self, stop: asyncio.Event) -> None:
        """Owned by run(): every ``health_check_s`` ask the engine whether it lives, and whether it
        moved while it had work; a dead or wedged engine ends the worker."""
        s = self._s
        last, moved = self._engine.stats().steps, time.monotonic()
        while not stop.is_set() and self.engine_died is None:
            await _wait_any(stop, timeout=s.health_check_s)
            try:
                await asyncio.wait_for(self._engine.check_health(), max(s.health_check_s, 1.0))
            except EngineDead as exc:
                log.error("engine_unhealthy", error=exc.message)
                self.engine_died = exc
            except asyncio.TimeoutError:
                self.engine_died = EngineDead(f"the engine did not answer its health check in {s.health_check_s:g} s")
                self.wedged = True
            steps, now = self._engine.stats().steps, time.monotonic()
            if steps != last or not self._samples.in_engine or steps < 0:
                last, moved = steps, now
            elif s.wedge_timeout_s and now - moved > s.wedge_timeout_s and self.engine_died is None:
                inflight = self._samples.in_engine
                why = f"the engine made no progress for {now - moved:.0f} s with {inflight} requests in flight"
                log.error("engine_wedged", inflight=inflight, idle_s=round(now - moved, 1))
                self.engine_died, self.wedged = EngineDead(why), True
            if self.engine_died is not None:
                self._set_state(WorkerState.FAILED, self.engine_died.message)
                self._slot_free.set()  # wake the lease loop

    async def _abandon(self) -> None:
        """A wedged engine: cancel every job task without waiting on the engine (each still writes its
        terminal event, worker_lost, so gateways resume it elsewhere)."""
        self._handing_back.set()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._outbox.close(), 5)

    async def _admit(self, lease: Lease) -> None:
        rid = lease.request.request_id
        if lease.request.batch_id and self._batches is not None:
            if lease.cancelled or lease.expired:
                await record(self._batches, lease, skipped_result(lease))
            elif rid in self._tasks:
                running = self._batch_running.get(rid)
                if running is not None and running.entry_id == lease.entry_id:
                    # Its own entry, claimed back (its touches missed while Redis was out): it runs
                    # here already, and stays leased until it records its result.
                    return
                # The same item queued twice (a resubmitted batch): run it once. Not dropped now (Redis
                # out): it stays leased and comes back later, as a duplicate then or to run if the first
                # copy ended without a result.
                with contextlib.suppress(QueueUnavailable):
                    await self._batches.discard(lease)
            else:
                self._start(lease)
        elif lease.cancelled:
            await self._outbox.finish(lease, cancelled_event(lease, self.name))
            log.info("job_skipped_cancelled", request_id=rid)
        elif lease.started:
            # A dead worker had begun it and its caller has those tokens: a run from the start would
            # send them again. End it; the gateway resumes it elsewhere from what the caller has.
            died = WorkerDied("the worker running it died; it is resumed from the tokens already sent")
            await self._outbox.finish(lease, JobEvent(worker=self.name, failed=failure_of(died)))
            log.info("job_not_restarted", request_id=rid)
        else:
            self._start(lease)

    async def _lease(self, free: int) -> list[Lease]:
        """Up to ``free`` jobs: interactive ones first; batch items fill what is left up to
        ``max_share`` of the slots, and get ``min_share`` even while interactive work queues.

        With batches on, the blocking read of the interactive stream waits at most 100 ms, so that
        batch items (on another stream) are picked up as slots free; about ten reads a second idle."""
        pool, name, step = self._s.pool, self.name, max(1, self._s.lease_batch)
        taken = await self._reclaim_jobs(free)
        free -= len(taken)
        if free <= 0:
            return taken
        if self._batches is None:
            return [*taken, *await self._interactive(free, self._block_ms)]
        slots = self._s.max_inflight
        cap = max(1, int(slots * self._b.max_share))
        floor = min(cap, math.ceil(slots * self._b.min_share))
        batch: list[Lease] = []
        now = time.monotonic()
        if now - self._last_reclaim >= self._b.claim_idle_s / 2:  # items of workers that died
            self._last_reclaim = now
            room = min(free, cap - len(self._batch_running))
            if room > 0:
                batch += await self._batches.reclaim(pool, name, int(self._b.claim_idle_s * 1000), room)
        reserve = min(free - len(batch), floor - len(self._batch_running) - len(batch))
        if reserve > 0:
            batch += await self._batches.lease_items(pool, name, reserve, None)
        free -= len(batch)
        inter = await self._interactive(free, min(self._block_ms, 100)) if free > 0 else []
        free -= len(inter)
        room = min(free, cap - len(self._batch_running) - len(batch), step)
        if room > 0:  # not blocking: an idle Redis ends a short BLOCK only at its next tick (100 ms)
            batch += await self._batches.lease_items(pool, name, room, None)
        return [*taken, *inter, *batch]

    async def _interactive(self, free: int, block_ms: int) -> list[Lease]:
        """Up to ``free`` interactive jobs, keeping ``tenant_headroom`` slots for tenants with
        nothing running here: when only those are left, a non-blocking look at the other tenants'
        streams (``_polling``: the lease loop looks again every ``headroom_poll_s``)."""
        pool, name, step = self._s.pool, self.name, max(1, self._s.lease_batch)
        busy = {x.tenant for x in self._running.values()}
        headroom = min(self._s.tenant_headroom, self._s.max_inflight - 1)
        self._polling = 0 < free <= headroom
        if self._polling:
            leases = await self._queue.lease(pool, name, min(free, step), 0, exclude=busy)
        else:
            leases = await self._queue.lease(pool, name, min(free - headroom, step), block_ms)
        for x in leases:  # prefix affinity on: from its own partitions, or stolen from another's
            if x.partition is not None:
                metrics.AFFINITY_LEASES.labels(pool, "stolen" if x.stolen else "own").inc()
        return leases

    async def _reclaim_jobs(self, free: int) -> list[Lease]:
        """Every claim_idle_s / 2: jobs untouched for claim_idle_s (of workers that died, or its own
        that it does not run: leased but never started here, or acked in a Redis that lost it)."""
        now = time.monotonic()
        if now - self._last_job_reclaim < self._s.claim_idle_s / 2:
            return []
        self._last_job_reclaim = now
        s = self._s
        running = {x.ref for x in self._running.values()}  # entries of every tenant's stream
        return await self._queue.reclaim(
            s.pool, self.name, int(s.claim_idle_s * 1000), free, s.max_deliveries, running=running
        )

    def status(self) -> WorkerStatus:
        stats = self._engine.stats()
        if self.state is WorkerState.STARTING:
            doing = self._engine.starting or "starting the engine"
            if doing != self._detail:
                self._detail, self._since = doing, time.time()
        pool = self._s.pool
        metrics.WORKER_INFLIGHT.labels(pool).set(len(self._tasks))
        metrics.ENGINE_RUNNING.labels(pool).set(stats.running)
        metrics.ENGINE_WAITING.labels(pool).set(stats.waiting)
        metrics.KV_CACHE_USAGE.labels(pool).set(stats.kv_cache_usage)
        if stats.steps > self._steps_counted:  # -1: the engine does not count
            metrics.ENGINE_STEPS.labels(pool).inc(stats.steps - self._steps_counted)
            self._steps_counted = stats.steps
        return WorkerStatus(
            worker=self.name,
            pool=self._s.pool,
            model=self._s.model,
            engine=self._s.engine,
            inflight=len(self._tasks),
            max_inflight=self._s.max_inflight,
            running=stats.running,
            waiting=stats.waiting,
            kv_cache_usage=stats.kv_cache_usage,
            state=self.state.value,
            detail=self._detail,
            since_unix_s=self._since,
            adapters=tuple(getattr(self._engine, "adapters", ())),
            adapter_errors=tuple(f"{name}={path}: {why}" for (name, path), why in self._adapter_errors.items()),
            adapter_paths=tuple(f"{name}={path}" for name, path in sorted(self._loaded_at_runtime.items())),
        )

    def _check_adapter_root(self, path: str) -> None:
        """PermissionDenied for a run-time adapter outside LLAMAMESH_WORKER_ADAPTER_ROOT (when set)."""
        if not self._s.adapter_root:
            return
        root = Path(self._s.adapter_root).expanduser().resolve()
        if not Path(path).expanduser().resolve().is_relative_to(root):
            raise PermissionDenied(f"{path!r} is not under LLAMAMESH_WORKER_ADAPTER_ROOT")

    async def _sync_adapters_quietly(self) -> None:
        with contextlib.suppress(QueueUnavailable):  # the heartbeat's own line says Redis is out
            await self._sync_adapters()

    async def _sync_adapters(self) -> None:
        """Load the pool's run-time LoRA adapters (AdminService LoadAdapter) this worker does not have
        yet, unload those dropped (UnloadAdapter); one that fails to load is not tried again from the
        same path (its heartbeat says why)."""
        if self.state is not WorkerState.READY or not hasattr(self._engine, "load_adapter"):
            return
        engine: Any = self._engine
        wanted = await self._queue.adapters(self._s.pool)
        for name, path in wanted.items():
            if self._loaded_at_runtime.get(name) == path or name in self._own_adapters:
                continue
            if (name, path) in self._adapter_errors:
                continue
            if name in self._loaded_at_runtime:  # registered again from another folder: swap it
                try:
                    await engine.unload_adapter(name)
                except FailedPrecondition:
                    continue  # its requests first
                del self._loaded_at_runtime[name]
            try:
                self._check_adapter_root(path)
                await engine.load_adapter(name, path)
            except Exception as exc:
                why = exc.message if isinstance(exc, LlamameshError) else f"{type(exc).__name__}: {exc}"
                self._adapter_errors[(name, path)] = why
                log.warning("adapter_load_failed", adapter=name, path=path, error=why)
                continue
            self._loaded_at_runtime[name] = path
            log.info("adapter_loaded", adapter=name, path=path)
        for name in [n for n in self._loaded_at_runtime if n not in wanted]:
            try:
                await engine.unload_adapter(name)
            except FailedPrecondition as exc:  # requests still use it: the next heartbeat tries again
                log.info("adapter_unload_waits", adapter=name, why=exc.message)
                continue
            del self._loaded_at_runtime[name]
            log.info("adapter_unloaded", adapter=name)
        self._adapter_errors = {k: v for k, v in self._adapter_errors.items() if wanted.get(k[0]) == k[1]}

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """Owned by run(): every heartbeat_s, say this worker is alive (starting, then ready), until
        ``stop`` (set by run() once it has drained) or engine death."""
        try:
            while not stop.is_set() and self.engine_died is None:
                if self._adapter_sync is None or self._adapter_sync.done():
                    # Beside the heartbeat, never in its way: loading an adapter can take seconds.
                    self._adapter_sync = asyncio.create_task(self._sync_adapters_quietly(), name="adapter-sync")
                try:
                    jobs = [x.ref for x in self._running.values()]
                    await self._queue.heartbeat(self.status(), self._s.heartbeat_ttl_s, touch=jobs)
                    if self._batches is not None and self._batch_running:
                        items = [x.entry_id for x in self._batch_running.values()]
                        await self._batches.touch(self._s.pool, self.name, items)
                except QueueUnavailable:
                    log.warning("heartbeat_failed")
                await _wait_any(stop, timeout=self._s.heartbeat_s)
        finally:
            if self._adapter_sync is not None:
                self._adapter_sync.cancel()
                await asyncio.gather(self._adapter_sync, return_exceptions=True)

    async def _drain(self) -> None:
        """Stop leasing; give in-flight jobs ``grace_s`` to finish, abort the rest. If the event writer
        fails meanwhile, return at once with the jobs as they are (the worker is wedged then: nothing
        they do can be published; run() abandons them)."""
        if self._tasks:
            log.info("worker_draining", inflight=len(self._tasks), grace_s=self._s.grace_s)
            tasks = list(self._tasks.values())
            await _first(asyncio.wait(tasks), self._writer_failed.wait(), timeout=self._s.grace_s)
            if self.wedged:
                log.error("worker_drain_cut", reason=self.engine_died.message if self.engine_died else "wedged")
                return
            pending = {t for t in tasks if not t.done()}
            self._handing_back.set()
            for rid in list(self._tasks):
                await self._samples.abort(rid)
            if pending:
                _done, still = await asyncio.wait(pending, timeout=5)
                for t in still:
                    t.cancel()
                await asyncio.gather(*still, return_exceptions=True)
        await self._outbox.close()


async def _wait_any(*events: asyncio.Event, timeout: float | None = None) -> None:
    await _first(*(e.wait() for e in events), timeout=timeout)


async def _first(*awaitables: Awaitable[Any], timeout: float | None = None) -> None:
    """Until the first of ``awaitables`` is done (or ``timeout``); the others are cancelled."""
    waiters = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
