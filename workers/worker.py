"""The worker (:class:`Worker`): leases jobs of one pool, runs them on one engine, publishes their
events. Its parts, each owned by the Worker (which starts, cancels and awaits their tasks): the lease
loop (workers/leasing.py), the jobs in flight (workers/inflight.py), the event writer
(workers/outbox.py), the heartbeat (workers/heartbeat.py, with the run-time LoRA adapters of
workers/lora.py) and the engine watchdog (workers/watchdog.py), sharing its state (workers/life.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from llamamesh.backoff import Delays
from llamamesh.errors import EngineDead, InvalidRequest, QueueRefused, QueueUnavailable
from llamamesh.loop import serving_heap
from llamamesh.queue.protocol import BatchStore, WorkQueue
from llamamesh.settings import BatchSettings, WorkerSettings
from llamamesh.types import WorkerState, WorkerStatus
from workers.allowance import BatchAllowance
from workers.engines.base import Engine
from workers.heartbeat import Heartbeat
from workers.inflight import Inflight
from workers.leasing import Leasing
from workers.life import Life
from workers.lora import LoraAdapters
from workers.outbox import Outbox
from workers.samples import Samples
from workers.watchdog import Watchdog

log = structlog.get_logger(__name__)

# How long a worker that could not start stays visible as ``failed`` (with its reason) after it exits.
FAILED_TTL_S = 60.0


class Worker:
    """One worker. The heartbeat starts as soon as Redis answers, before the engine is ready, with
    state ``starting`` and what the engine's start is doing (converting, loading, compiling);
    gateways treat the pool as coming up. Then ``ready`` (leasing), or ``failed`` with the reason when
    the engine cannot start (kept visible for a minute, then the process exits non-zero). A start
    step that blocks the event loop (imports, vLLM's engine start) is announced with a heartbeat that
    lives ``start_timeout_s``, since no refresh can run meanwhile; while the loop runs the heartbeat
    is refreshed every ``heartbeat_s`` with the short TTL, so a worker that dies is gone within it."""

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
        self._batches = batches
        self.name = settings.consumer_name()
        self.life = Life()
        self._samples = Samples(engine)  # generation jobs go through it (GenerateRequest.n)
        self.outbox = Outbox(queue, on_cancel=self._cancel, on_fail=self._outbox_failed)
        batch = batch or BatchSettings()
        self.allowance = BatchAllowance(batch, settings.max_inflight, settings.pool)
        self.jobs = Inflight(self._samples, self.outbox, batches, self.name, self.life, self.allowance)
        self._leasing = Leasing(
            settings, queue, batches, batch, self.allowance, block_ms, self.jobs, self.outbox, self.life
        )
        self.adapters = LoraAdapters(settings, queue, engine, self.life)
        self._heartbeat = Heartbeat(settings, queue, batches, engine, self.life, self.jobs, self.adapters)
        self._watchdog = Watchdog(settings, engine, self._samples, self.life)
        self.ready = asyncio.Event()
        self.join_failures = 0

    @property
    def inflight(self) -> int:
        return len(self.jobs)

    @property
    def state(self) -> WorkerState:
        return self.life.state

    @property
    def engine_died(self) -> EngineDead | None:
        return self.life.engine_died

    @property
    def wedged(self) -> bool:
        return self.life.wedged

    def status(self) -> WorkerStatus:
        return self._heartbeat.status()

    async def run(self, stop: asyncio.Event) -> None:
        """Start the engine (heartbeats say ``starting`` meanwhile), then lease and run jobs until
        ``stop`` is set or the engine dies, then drain.

        Raises EngineDead (after draining) if the engine could not start, died or wedged, or the event
        writer failed (workers/outbox.py), so the process exits non-zero. A dead engine stops the
        worker (drain, exit 1); a wedged one, or an event writer that failed, makes it withdraw its
        heartbeat at once, so that gateways fail its streams over, and exit 1 without waiting on the
        engine.
        """
        if not await self._join(stop):
            return
        self.outbox.start()
        beat_stop = asyncio.Event()
        beat = asyncio.create_task(self._heartbeat.run(beat_stop), name="heartbeat")
        watchdog: asyncio.Task[None] | None = None
        try:
            if await self._start_engine(stop):
                watchdog = await self._become_ready(stop)
                if self._freeze:
                    log.info("heap_frozen", objects=serving_heap())
                await self._leasing.run(stop)
        finally:
            if watchdog is not None:
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)
            await self._leave(beat_stop, beat)
        if self.life.engine_died is not None:
            raise self.life.engine_died

    async def _join(self, stop: asyncio.Event) -> bool:
        """Join the pool's consumer groups, waiting for Redis (it may come up after the worker) rather
        than exit; False if ``stop`` came first. Raises QueueRefused when Redis refuses what the queue needs."""
        delays = Delays(first_s=0.1, cap_s=2.0)
        while True:
            try:
                await self._queue.preflight()
                await self._queue.join(self._s.pool)
                if self._batches is not None:
                    await self._batches.join(self._s.pool)
                return True
            except QueueRefused:
                raise
            except QueueUnavailable as exc:
                self.join_failures += 1
                wait_s = round(await delays.wait(stop), 3)
                log.warning("join_failed", pool=self._s.pool, error=exc.detail, retry_in_s=wait_s)
                if stop.is_set():
                    return False

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
            self._start_failed(f"the {s.engine} engine did not start within {s.start_timeout_s:g} s")
            return False
        except (EngineDead, InvalidRequest) as exc:
            self._start_failed(exc.message)
            return False
        finally:
            stopping.cancel()
        log.info("engine_started", engine=s.engine, start_s=round(time.monotonic() - t0, 2))
        return True

    def _start_failed(self, why: str) -> None:
        log.error("engine_start_failed", engine=self._s.engine, error=why)
        self.life.fail(EngineDead(why))

    async def _become_ready(self, stop: asyncio.Event) -> asyncio.Task[None]:
        """Take this consumer's own leased jobs first (a restart under the same name), say ready, and
        start the engine watchdog (returned: run() owns it)."""
        await self._leasing.reclaim_own()
        self.life.set(WorkerState.READY)
        self.ready.set()
        log.info("worker_started", pool=self._s.pool, worker=self.name, max_inflight=self._s.max_inflight)
        return asyncio.create_task(self._watchdog.run(stop), name="engine-watchdog")

    async def _leave(self, beat_stop: asyncio.Event, beat: asyncio.Task[None]) -> None:
        """Drain (unless wedged), stop the heartbeat, then withdraw it, or leave it saying why the
        worker failed; a wedged worker abandons its jobs (gateways fail them over now, not after a
        drain that cannot end)."""
        life = self.life
        if not life.wedged:
            # Heartbeats go on while draining: the gateways must not take its streams for lost. The
            # drain is cut short if the event writer fails meanwhile (then wedged).
            await self.jobs.drain(self._s.grace_s)
        beat_stop.set()
        await asyncio.gather(beat, return_exceptions=True)
        with contextlib.suppress(QueueUnavailable):
            if life.wedged or life.state is not WorkerState.FAILED:
                await self._queue.leave(self._s.pool, self.name)
            else:  # say why for a while after it is gone
                await self._queue.heartbeat(self.status(), FAILED_TTL_S)
        if life.wedged:
            await self.jobs.abandon()

    async def _cancel(self, request_id: str) -> None:
        log.info("job_cancel_requested", request_id=request_id)
        await self._samples.abort(request_id)

    def _outbox_failed(self, exc: BaseException) -> None:
        """The event writer stopped on an unexpected error: no stream of this worker can move on. Leave
        at once, as for a wedged engine (heartbeat withdrawn: the gateways fail its streams over; the
        jobs stay unacked for others to take), and exit non-zero."""
        self.life.fail(EngineDead(f"the worker could not publish its events: {exc!r}"), wedged=True)
        self.life.writer_failed.set()  # cuts a drain in progress short
