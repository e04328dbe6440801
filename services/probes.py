"""The gateway's reading of its pools through the queue, which feeds their state and breakers: one
probe task per pool (``Probes``), reading the pool's heartbeats and sending it a one-token request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

import structlog

from llamamesh import errors, metrics
from llamamesh.loop import cancel_and_wait
from llamamesh.queue.protocol import ProbeQueue, QueueDepth
from llamamesh.settings import BreakerSettings
from llamamesh.types import PROBE_TENANT, GenerationRequest, SamplingParams, WorkerState
from services.attempts import handed_back
from services.breaker import State
from services.outage import QueueOutage
from services.pool import Pool

log = structlog.get_logger(__name__)

PROBE_PROMPT = "ping"


class Probes:
    """The probe tasks of one gateway's pools; ``publish(pool)`` tells the pool's health after a
    change."""

    def __init__(
        self,
        queue: ProbeQueue,
        settings: BreakerSettings,
        outage: QueueOutage,
        publish: Callable[[Pool], Awaitable[None]],
        clock: Callable[[], float],
    ) -> None:
        self._queue = queue
        self._s = settings
        self._outage = outage
        self._publish = publish
        self._clock = clock
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, pools: Iterable[Pool]) -> None:
        """Probe each pool every ``probe_interval_s`` in the background."""
        self._tasks = [asyncio.create_task(self._loop(p), name=f"probe-{p.name}") for p in pools]

    async def stop(self) -> None:
        # Cancelled until they end: on Python < 3.12 asyncio.wait_for can swallow a cancel that
        # lands as the awaited probe finishes (gh-86296), and the loop would probe on forever.
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def _loop(self, p: Pool) -> None:
        while True:
            await asyncio.sleep(self._s.probe_interval_s)
            try:
                await self.probe(p)
            except Exception as exc:  # a probe must never take the gateway down
                log.exception("probe_crashed", pool=p.name, error=str(exc))

    async def queue_depth(self, pool: str) -> QueueDepth | None:
        """The pool's jobs waiting and leased now; None while the queue is unreachable."""
        try:
            return await self._queue.queue_depth(pool)
        except errors.QueueUnavailable:
            self._outage.saw_queue(False)
            return None

    async def refresh(self, p: Pool) -> None:
        """Read the pool's heartbeats: its workers, and the breaker revived when they come back.
        Workers that report ``failed`` count as absent, and their reasons go into the errors callers
        get. While Redis is out the workers known before are kept; after it, a worker whose heartbeat
        expired during the outage gets ``liveness_grace_s`` to heartbeat again before it counts as
        lost."""
        was_live, was_present, was_starting, before = p.live, p.present, p.starting, p.workers
        # Unknown is not dead: while Redis is out the workers are kept (probes and submits fail
        # meanwhile); and right after it, their heartbeats (expired while it was out) get one round
        # to come back before a worker counts as lost.
        try:
            seen = tuple(await self._queue.workers(p.name))
        except errors.QueueUnavailable:
            p.unreachable = True
            self._outage.saw_queue(False)
        else:
            now = self._clock()
            if p.unreachable or self._outage.writes_refused:  # back (or no heartbeat can be written):
                p.kept_until = now + self._s.liveness_grace_s  # what it knew stands for one more round
            names = {w.worker for w in seen}
            kept = tuple(w for w in p.workers if w.worker not in names) if now < p.kept_until else ()
            p.workers = seen + kept
            p.unreachable = False
            self._outage.saw_queue(True)
            metrics.workers_seen(p.name, (w.state for w in p.workers), (s.value for s in WorkerState))
        if was_present and not p.present:
            p.empty_since = self._clock()
        if was_live and not p.live:
            p.vanished = frozenset((w.worker, w.since_unix_s) for w in before if w.ready)
        if p.starting and not was_starting:
            p.starting_since = self._clock()
        p.ever_live = p.ever_live or p.live
        if p.starting and not was_present and p.breaker.state is State.OPEN and p.opened_empty:
            # It opened for want of workers; they are coming up now: requests wait, not refused.
            p.breaker.revive(f"{len(p.workers)} worker(s) starting", close=True)
        elif p.live and not was_live:
            back = sorted(w.worker for w in p.workers if w.ready and (w.worker, w.since_unix_s) in p.vanished)
            if back:  # a worker whose heartbeat stopped, back without a restart: tried before it is trusted
                p.breaker.revive(f"worker {back[0]} is back after its heartbeat stopped")
            else:
                p.breaker.revive(f"{len(p.workers)} live worker(s) again", close=p.opened_empty)
        await self._publish(p)

    async def probe(self, p: Pool) -> None:
        """One probe of one pool: heartbeats, then (if anyone is alive and the breaker lets it) a
        one-token greedy generation through the queue, like any request; its result feeds the
        pool's breaker. With no live (ready) worker the probe fails at once (no job is queued for
        nobody). A pool whose workers are all still starting (heartbeat state ``starting``:
        converting, loading, compiling) is coming up, not failing: nothing is recorded against it."""
        started = self._clock()
        await self.refresh(p)
        if p.unreachable:  # Redis is out: nothing to learn about the pool
            return
        if (depth := await self.queue_depth(p.name)) is not None:  # for the metrics, once a probe
            p.waiting = depth.waiting
            metrics.QUEUE_DEPTH.labels(p.name).set(depth.waiting)
            metrics.QUEUE_PENDING.labels(p.name).set(depth.leased)
        if p.starting:  # coming up: nothing to hold against it
            p.last_probe_error = f"starting: {p.what_is_wrong()}"
            await self._publish(p)
            return
        if not p.live:
            wrong = p.what_is_wrong()
            await self.result(p, "no live worker" + (f" ({wrong})" if wrong else ""))
            return
        if not p.breaker.allow():
            return
        p.probes += 1
        error = await self._generation(p.name)
        if error is None:  # Redis went out meanwhile
            return
        if error and self._outage.troubled(since=started):
            log.info("probe_ignored", pool=p.name, error=error, detail="Redis was unreachable during the probe")
            return
        await self.result(p, error)

    async def _generation(self, pool: str) -> str | None:
        """A one-token generation through the queue, within ``probe_timeout_s``: "" or what went
        wrong; None when the queue was unreachable."""
        request = GenerationRequest(
            request_id=f"probe~{pool}~{uuid.uuid4().hex[:12]}",  # "~": in no caller's id
            model="",
            prompt=PROBE_PROMPT,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            accepted_unix_ns=time.time_ns(),
            tenant=PROBE_TENANT,  # its own work stream: never behind a tenant's backlog
        )
        try:
            return await asyncio.wait_for(self._followed(pool, request), self._s.probe_timeout_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(errors.QueueUnavailable):
                await self._queue.cancel(request.request_id)
            return f"no answer in {self._s.probe_timeout_s:g} s"
        except errors.QueueUnavailable:
            self._outage.saw_queue(False)
            return None

    async def _followed(self, pool: str, request: GenerationRequest) -> str:
        """Submit the probe and follow it to its end: "" or what went wrong."""
        await self._queue.submit(pool, request)
        async for _id, ev in self._queue.events(request.request_id):
            if ev.failed is not None:
                return f"{ev.failed.code}: {ev.failed.message}"
            if ev.handed_back:  # its worker drained or lost its engine: no other carries a probe on
                await self._queue.cancel(request.request_id)
                lost = handed_back(ev)
                return f"{lost.code}: {lost.message}"
            if ev.terminal:
                return ""
        return "the probe's events ended without a terminal one"

    async def result(self, p: Pool, error: str) -> None:
        """Record a probe's result ("" or what went wrong) in the pool's breaker."""
        if error and p.breaker.state is not State.OPEN:  # said once while it fails the same way, then debug
            (log.debug if error == p.last_probe_error else log.warning)("probe_failed", pool=p.name, error=error)
        p.last_probe_error = error
        was_open = p.breaker.state is State.OPEN
        p.breaker.record(not error, probe=True, reason=error)
        if p.breaker.state is State.OPEN and not was_open:
            # A pool with no live worker (a cold start, or its workers went away: their requests
            # were counted when they failed) opened for want of one, not for failures of one.
            p.opened_empty = not p.live
        await self._publish(p)
