"""One relayed Generate (``RelayedRequest``): its state from the routing to the end of its stream:
routing and the attempt record, failover (services/attempts.py makes each next attempt), the stream
invariant over every attempt's events (services/cursor.py), liveness while it waits
(services/liveness.py), and the bookkeeping on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

import structlog

from llamamesh import errors, metrics, tracing
from llamamesh.queue.protocol import RelayQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import Attempt, Finished, FinishReason, GenerationRequest, JobEvent, public_id
from services.attach import Attachment
from services.attempts import handed_back, next_attempt, raise_failure, spent_samples
from services.backends import Backends
from services.cursor import SampleCursors, shifted
from services.detach import DetachTimers, cancel_quietly
from services.liveness import Liveness
from services.routing import Access, RoutingPolicy

log = structlog.get_logger(__name__)

# The ways an attempt is lost while the request can go on elsewhere. Lost events are Redis's doing:
# the attempt is abandoned and the request resumed from what the caller has, as after a lost worker.
ATTEMPT_LOST = (errors.WorkerLost, errors.EngineDead, errors.EventsLost)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as the relay cares: the digest of what it sent (a request id
    reused for a different request is refused), the pools it may use, its fair-share weight."""

    fingerprint: str = ""
    access: Access = field(default_factory=Access)
    weight: float = 1.0


@dataclass
class Progress:
    """What one relayed request did, for its ``rpc_finished`` line."""

    pool: str = ""
    route: str | None = None
    failovers: int = 0
    finish: str = ""
    tokens: int = 0
    ttft_ms: float | None = None
    detached: bool = False  # its caller left a resumable request, which goes on generating


@dataclass(frozen=True)
class RelayParts:
    """What every request of one relay shares."""

    queue: RelayQueue
    settings: GatewaySettings
    backends: Backends | None
    policy: RoutingPolicy
    liveness: Liveness
    timers: DetachTimers


class RelayedRequest:
    """The state of one relayed request (``pool``: its model's pool). ``events`` runs it; the steps
    it takes are the other public methods, in the order they are listed."""

    def __init__(
        self,
        parts: RelayParts,
        request: GenerationRequest,
        pool: str,
        progress: Progress,
        resumable: bool = False,
        caller: Caller | None = None,
    ) -> None:
        self._p = parts
        self.req = request
        self.progress = progress
        self.resumable = resumable
        self.who = caller or Caller()
        self.streams = SampleCursors(request.sampling.samples)
        self.target = pool  # the pool the routing rules chose (``route``)
        self.pool = ""  # where the current attempt runs
        self.attempt: GenerationRequest | None = None  # the current attempt's job
        self.record: Attempt | None = None
        self.base = 0  # tokens the caller had when the current attempt began
        self.attempts = self.deaths = 0
        self.writer = ""  # the worker that wrote the current attempt's last event
        self.submitted = False  # the current attempt's job is queued
        self.finished = False  # the current attempt's terminal event was read
        self.failure: BaseException | None = None  # what ended the stream, if not its end
        self.reading = False  # counted among the resumable request's readers (``DetachTimers.came``)
        self._recorder: metrics.PoolRecorder | None = None
        self._t0 = 0.0
        self._first_token_ns = 0
        self._last_token_at = 0.0

    async def events(self) -> AsyncGenerator[JobEvent, None]:
        """The request's events as its caller numbers them, to the terminal one. Raises domain
        errors (a failure event becomes its error). However it ends, ``leave`` does the bookkeeping:
        when the caller goes away first (cancellation or ``aclose``), a resumable request is
        detached, any other cancelled."""
        self._t0 = time.perf_counter()
        try:
            self.route()
            while True:
                self.place()
                for ev in self.spent_ends():
                    yield ev
                if self.finished:
                    return
                if not await self.queued():
                    async with aclosing(self.follow_accepted()) as accepted:
                        async for ev in accepted:
                            yield ev
                    return
                try:
                    async with aclosing(self.read()) as read:
                        async for ev in read:
                            yield ev
                    return
                except ATTEMPT_LOST as exc:
                    await self.fail_over(exc)
        except BaseException as exc:  # recorded for the pool, and to tell a caller gone from an error
            self.failure = exc
            raise
        finally:
            await self.leave()

    def route(self) -> None:
        """Choose the pool by the routing rules (once). Raises PermissionDenied (no pool it may use)."""
        self.target, chosen = self._p.policy.choose(self.req, self.target, self.who.access)
        self.progress.route = chosen.text if chosen is not None else None

    def place(self) -> None:
        """The pool of the next attempt: the routed one or its fallback, as the pools' breakers say
        now (never one the caller may not use). Raises NoWorkers when neither can take it."""
        backends = self._p.backends
        pool = backends.route(self.target) if backends is not None else self.target
        self.pool = self.progress.pool = pool if self.who.access.allows(pool) else self.target

    def spent_ends(self) -> Iterator[JobEvent]:
        """After a lost attempt, the ends of the samples whose every token the caller has (only their
        end was missing): they end here, the last one ending the request (``finished``)."""
        if not self.attempts:
            return
        for ev in spent_samples(self.req, self.streams):
            self.finished = ev.terminal
            self.streams.accept(ev)
            self.progress.finish = FinishReason.LENGTH.value
            yield ev

    async def begin(self) -> bool:
        """Make the next attempt and record it (for Attach) before its job is queued, once it can run
        in time (raises NoWorkers for a pool nobody came to for a while, DeadlineUnreachable). False:
        this request id was accepted before (a retry after a lost reply, or another request under a
        taken id)."""
        self.attempt = next_attempt(self.req, self.attempts, self.streams)
        self.base = self.streams.total
        self._p.liveness.check_pool(self.pool)  # no worker came for a while: say so now, not at the deadline
        self._p.liveness.check_reachable(self.pool, self.req.deadline_unix_ns)
        req, who = self.req, self.who
        self.record = Attempt(
            self.attempt.request_id,
            self.base,
            self.pool,
            req.model,
            req.accepted_unix_ns,
            self.resumable,
            who.fingerprint,
            self.streams.bases(),
            tuple(sorted(self.streams.ended)),
        )
        return await self._p.queue.begin(req.request_id, self.record, first=self.attempts == 0)

    async def queued(self) -> bool:
        """``begin``, then ``submit`` when it is True: a caller gone meanwhile does not cut them in
        two (a record with no job would keep an Attach or a retry waiting for ever); both end, then
        CancelledError is raised, and ``leave`` detaches or cancels the job."""

        async def both() -> bool:
            if not await self.begin():
                return False
            await self.submit()
            return True

        step = asyncio.ensure_future(both())
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            await asyncio.wait([step])
            _ = step.cancelled() or step.exception()  # (retrieved: the cancellation is what it raises)
            raise

    async def follow_accepted(self) -> AsyncGenerator[JobEvent, None]:
        """The request accepted before under this id, followed as it is (one job). Raises
        AlreadyExists when the id names a different request."""
        await self._same_request()
        log.info("request_retried", request_id=self.req.request_id)
        p = self._p
        earlier = Attachment(p.queue, p.liveness, p.timers, self.req.request_id, 0, count=False)
        async with aclosing(earlier.events()) as events:
            async for _head, ev in events:
                self.streams.accept(ev)
                yield ev
        self.finished = True

    async def _same_request(self) -> None:
        """Raise AlreadyExists unless the request first accepted under this id is this one."""
        records = await self._p.queue.attempts(self.req.request_id)
        first = records[0].fingerprint if records else ""
        if self.who.fingerprint and first and first != self.who.fingerprint:
            raise errors.AlreadyExists(
                f"request id {public_id(self.req.request_id)!r} names another request; retry it unchanged to "
                "attach to it, or use a new id"
            )

    async def submit(self) -> None:
        """Queue the current attempt's job. Raises QueueFull (with the delay to retry after) or
        QueueUnavailable; a first attempt that was not queued leaves no record."""
        p, attempt = self._p, self.attempt
        assert attempt is not None  # made by ``begin``
        try:
            await p.queue.submit(self.pool, attempt, max_waiting=p.settings.max_queue, weight=self.who.weight)
        except errors.QueueFull as exc:
            metrics.rejected(exc)
            if self.attempts == 0:
                await p.queue.forget(self.req.request_id)
            raise errors.QueueFull(exc.message, retry_after_s=p.settings.retry_after_s) from None
        except errors.QueueUnavailable:
            # Queued or not (a lost reply): the record goes, if Redis lets it, so that the caller's
            # retry submits again (a submission that did land is not queued twice: its marker).
            if self.attempts == 0:
                with contextlib.suppress(errors.QueueUnavailable):
                    await p.queue.forget(self.req.request_id)
            raise
        self.submitted, self.finished = True, False
        if self.resumable and not self.reading:  # its caller reads it (a failover does not count again)
            self.reading = True
            await self._p.timers.came(self.req.request_id)
        tracing.event("job_submitted", pool=self.pool, job=attempt.request_id, attempt=self.attempts)
        if self._recorder is None or self._recorder.pool != self.pool:
            self._recorder = metrics.pool_recorder(self.pool)

    async def read(self) -> AsyncGenerator[JobEvent, None]:
        """The current attempt's events as the caller numbers them, less what it has, to the terminal
        one (its liveness watched). Raises the error of a failure event, EventsLost for a gap, and
        WorkerLost or EngineDead for a lost attempt."""
        assert self.attempt is not None  # made by ``begin``
        self.writer = ""
        async with aclosing(self._p.liveness.watched(self.pool, self.attempt.request_id)) as events:
            async for raw in events:
                if raw.failed is None:  # (a failure a claiming worker wrote counts in ``fail_over``)
                    self._note_writer(raw.worker)
                self.finished = raw.terminal
                raise_failure(raw)
                if raw.handed_back:  # its worker gave it up (a drain, a dead engine): on to another at once
                    raise handed_back(raw)
                ev = self.accept(raw)
                if ev is None:
                    continue
                self._observe(ev)
                yield ev
                if self.finished:
                    return

    def _note_writer(self, worker: str) -> None:
        """Count a death when another worker wrote on the attempt: the one before died under it and
        this one carried it on (a hand-back would have ended the read first) before the gateway
        noticed, so a request that kills its workers is still set aside after max_worker_deaths."""
        if worker and self.writer and worker != self.writer:
            self.deaths += 1
        self.writer = worker or self.writer

    def accept(self, raw: JobEvent) -> JobEvent | None:
        """An event of the current attempt renumbered as the caller's stream, less what the caller has
        (None: nothing); its new tokens counted for the pool. Raises EventsLost for a gap."""
        if self.base:
            assert self.record is not None  # made by ``begin``
            raw = shifted(raw, self.record.base_of(raw.sample), self._first_token_ns, usage_base=self.base)
        accepted = self.streams.accept(raw)
        total = self.streams.total
        backends = self._p.backends
        if backends is not None and total > self.progress.tokens:
            backends.count_tokens(self.pool, total - self.progress.tokens)
        self.progress.tokens = total
        return accepted

    def _observe(self, ev: JobEvent) -> None:
        """The metrics and progress of an event the caller gets: time to first token, inter-token
        latency, the finish, the prompt's tokens and the queue wait."""
        recorder = self._recorder
        assert recorder is not None  # made by ``submit``
        if ev.token_ids:
            now = time.perf_counter()
            if self.progress.ttft_ms is None:
                self.progress.ttft_ms = round((now - self._t0) * 1000, 2)
                self._first_token_ns = time.time_ns()
                recorder.ttft.observe(now - self._t0)
                tracing.event("first_token", ttft_ms=self.progress.ttft_ms)
            else:
                recorder.itl.observe(now - self._last_token_at)
            self._last_token_at = now
        if ev.ends_sample is not None:
            self.progress.finish = ev.ends_sample.value
        if ev.finished is not None:
            recorder.prompt.inc(ev.finished.usage.prompt_tokens)
            self._observe_wait(ev.finished)

    def _observe_wait(self, f: Finished) -> None:
        """The first attempt's queue wait (accepted -> a worker started it), for the pool's figures."""
        if not f.started_unix_ns or self.attempts:
            return
        assert self.attempt is not None
        wait_s = max(0, f.started_unix_ns - self.attempt.accepted_unix_ns) / 1e9
        if self.attempt.accepted_unix_ns:
            metrics.QUEUE_WAIT.labels(self.pool).observe(wait_s)
        if self._p.backends is not None:
            self._p.backends.observe_queue_wait(self.pool, wait_s)

    async def fail_over(self, exc: errors.WorkerLost | errors.EngineDead | errors.EventsLost) -> None:
        """The current attempt is lost (its worker lost, its engine dead, or its events lost): raise
        when the request goes no further (set aside when its workers keep dying, or out of its
        ``failover_attempts``); else the lost attempt is cancelled and the next one goes on elsewhere:
        before any token it starts again, after tokens it resumes from what the caller has. Each
        attempt has its own event stream, so an abandoned attempt's events are never relayed."""
        self.deaths += isinstance(exc, errors.EngineDead) or (isinstance(exc, errors.WorkerLost) and exc.running)
        await self._give_up_or_cancel(exc)
        tracing.event("failover", pool=self.pool, error=exc.code, tokens=self.streams.total)
        self.attempts = self.progress.failovers = self.attempts + 1
        self.submitted = self.finished = False

    async def _give_up_or_cancel(self, exc: errors.WorkerLost | errors.EngineDead | errors.EventsLost) -> None:
        """Raise when the request goes no further; else cancel the lost attempt (a worker that comes
        back skips it). The lost attempt counts against no breaker: the request goes on, and its
        outcome is what counts (``leave``). One worker's death loses every attempt it held at once;
        were each a failure, it would open its pool's breaker while the other workers serve."""
        s, backends, pool = self._p.settings, self._p.backends, self.pool
        if s.max_worker_deaths and self.deaths >= s.max_worker_deaths:
            # A poison request: the workers running it keep dying; no third one.
            await self._set_aside(self.deaths, exc)
            raise errors.SetAside(
                f"the request was set aside: {self.deaths} workers died running it, so it is not sent to "
                f"another; it is recorded in pool {pool!r}'s dead-letter stream"
            ) from exc
        if backends is None or self.attempts >= s.failover_attempts:
            if self.attempts:  # it outlived every worker it was sent to: keep it for inspection
                await self._set_aside(self.attempts + 1, exc)
            raise exc
        assert self.attempt is not None
        await asyncio.shield(cancel_quietly(self._p.queue, self.attempt.request_id))
        metrics.FAILOVERS.labels(pool).inc()
        log.warning(
            "request_failed_over",
            pool=pool,
            error=str(exc),
            attempt=self.attempts + 1,
            resumed_tokens=self.streams.total,
        )

    async def _set_aside(self, deliveries: int, exc: BaseException) -> None:
        """Record the request in its pool's dead-letter stream (a failure to is logged)."""
        try:
            reason = f"{deliveries} workers were lost running it: {exc}"
            await self._p.queue.set_aside(self.pool, self.req, reason, deliveries)
            metrics.DEAD_LETTERS.labels(self.pool).inc()
        except errors.QueueUnavailable:
            log.warning("set_aside_failed", request_id=self.req.request_id)

    async def leave(self) -> None:
        """The bookkeeping when the stream ends, however it ends: the tokens sent counted, an attempt
        still running detached or cancelled, the outcome recorded for the pool's breaker."""
        if self._recorder is not None and self.streams.total:
            self._recorder.generated.inc(self.streams.total)
        if self.reading:
            await asyncio.shield(self._p.timers.went(self.req.request_id))
        if self.submitted and not self.finished and self.attempt is not None:
            await self._stop_attempt(self.attempt.request_id)
        backends = self._p.backends
        if backends is not None and self.progress.pool and (self.submitted or self.failure is not None):
            # The caller going away (GeneratorExit: it stopped reading) is its doing, not the pool's.
            outcome = asyncio.CancelledError() if isinstance(self.failure, GeneratorExit) else self.failure
            await asyncio.shield(backends.record(self.progress.pool, outcome))

    async def _stop_attempt(self, job_id: str) -> None:
        """The stream ended before the attempt did: detached or cancelled (``DetachTimers.stop``)."""
        gone = self.failure is None or isinstance(self.failure, asyncio.CancelledError | GeneratorExit)
        self.progress.detached = gone and self.resumable
        await self._p.timers.stop(self.req.request_id, job_id, gone, self.resumable)
