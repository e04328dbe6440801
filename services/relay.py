"""The relay: the gateway's one owner of a request's stream, from the queue to the caller.

``Relay`` is the seam (shaped like vLLM's ``EngineClient``: generate, attach, cancel, tokenize);
``QueueRelay`` implements it over the queue, ``ScriptedRelay`` (services/fakes.py) is its fake for
tests of the gRPC layer. The RPC handlers only convert, call the relay and map errors to statuses.

What the relay owns:

- **The stream invariant** (``Cursor``): every token index reaches the caller exactly once and in
  order, across merged reads, failovers, re-attaches and Redis restarts. An event that repeats
  tokens the caller has (a publish the worker retried after a lost reply: the first try was
  applied) is dropped and counted (``duplicates_dropped``); one that starts past them is a gap
  (Redis came back without its last writes): the attempt is abandoned and the request resumed
  from what the caller has, as after a lost worker, or, with no attempt left, the stream ends
  UNAVAILABLE naming the lost range.
  Workers' publish retries are therefore safe to repeat: the reader drops by index what it has,
  rather than each writer choosing entry ids (an entry id the writer picks would have to sort
  after the ``*`` ids the gateway writes into the same stream, e.g. Cancel's terminal event).
- **Failover** (``generate``): when the worker is lost or its engine dies, the request goes on
  elsewhere (its pool or the fallback, as routed then), at most ``failover_attempts`` times;
  before any token it starts again, after tokens it resumes from what the caller has. Each
  attempt has its own event stream, so an abandoned attempt's events are never relayed.
- **Liveness**: while it waits, every probe interval, that its worker is still alive.
- **Detach timers** of resumable requests whose caller went away (cancelled at ``close``).
- **Cancel**, including the terminal event of a request no worker has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

import structlog

from llamamesh import errors, metrics, tracing
from llamamesh.queue.protocol import RelayQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import Attempt, Finished, FinishReason, GenerationRequest, JobEvent, Usage, public_id
from services.backends import Backends
from services.routing import Access, RoutingPolicy

log = structlog.get_logger(__name__)


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


class Relay(Protocol):
    def generate(
        self, request: GenerationRequest, pool: str, progress: Progress, resumable: bool = False,
        caller: Caller | None = None,
    ) -> AsyncGenerator[JobEvent, None]:  # fmt: skip
        """The request's events as its caller numbers them, to the terminal one. Raises domain
        errors (a failure event becomes its error; AlreadyExists when the request id names a
        different request of ``caller``'s tenant). When the iteration stops early (the caller went
        away: cancellation or ``aclose``), a resumable request is detached (cancelled after the
        re-attach grace unless someone attaches), any other is cancelled."""
        ...

    def attach(
        self, request_id: str, offset: int, count: bool = True, sample_offsets: Sequence[int] = ()
    ) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        """A request's events from token ``offset`` on (n > 1: each sample from its entry of
        ``sample_offsets``), through its attempts, to the end, each with the request as first
        accepted (id, model, acceptance time: what its responses echo)."""
        ...

    async def cancel(self, request_id: str) -> None:
        """The caller's Cancel: every attempt stops; a queued one's stream ends now."""

    async def tokenize(self, request: GenerationRequest, pool: str) -> JobEvent:
        """The tokenized event for ``request`` (a worker of ``pool`` owns the tokenizer)."""
        ...

    async def close(self) -> None:
        """Cancel the detach timers (the gateway is stopping)."""


def resumed(req: GenerationRequest, n: int, sent: Sequence[int]) -> GenerationRequest:
    """Attempt ``n`` of ``req`` after ``sent`` tokens reached the caller: it feeds them after the
    input and generates only the rest of the budget."""
    attempt_id = f"{req.request_id}~{n}"  # "~" is in no caller id: the two never meet
    if not sent:
        return replace(req, request_id=attempt_id, origin_id=req.request_id)
    s = req.sampling
    return replace(
        req,
        request_id=attempt_id,
        origin_id=req.request_id,
        resume_token_ids=tuple(sent),
        sampling=replace(
            s,
            max_tokens=None if s.max_tokens is None else s.max_tokens - len(sent),
            min_tokens=None if s.min_tokens is None else max(0, s.min_tokens - len(sent)),
        ),
    )


def resumed_samples(req: GenerationRequest, n: int, streams: SampleCursors) -> GenerationRequest:
    """Attempt ``n`` of a request of several samples: every sample that has not ended goes on from
    the tokens the caller has of it (the worker runs each on its own: workers/samples.py); with no
    token sent and none ended, the request starts again whole."""
    attempt_id = f"{req.request_id}~{n}"
    if not streams.total and not streams.ended:
        return replace(req, request_id=attempt_id, origin_id=req.request_id)
    todo = {k: tuple(c.sent) for k, c in streams.cursors.items() if k not in streams.ended}
    return replace(req, request_id=attempt_id, origin_id=req.request_id, resume_samples=MappingProxyType(todo))


def _shifted(ev: JobEvent, base: int, first_token_ns: int = 0, usage_base: int | None = None) -> JobEvent:
    """An event of a resumed attempt as the caller's stream numbers it: ``base`` tokens of its sample
    came before (``usage_base``: of every sample; default ``base``)."""
    f = ev.finished
    if f is not None:
        before = base if usage_base is None else usage_base
        f = replace(
            f,
            usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens + before),
            first_token_unix_ns=first_token_ns or f.first_token_unix_ns,
        )
    return replace(ev, index=ev.index + base, finished=f)


def _cut(ev: JobEvent, offset: int, end: int | None) -> JobEvent | None:
    """``ev`` (numbered as the caller's stream) cut to tokens [offset, end), with the text that goes
    with them (``JobEvent.text_before``: the pieces of any cuts add up to the whole text): None if
    nothing of it is left (a terminal event always stays, with what is left of its tokens and
    text)."""
    start, stop = ev.index, ev.index + len(ev.token_ids)
    lo, hi = max(start, offset), stop if end is None else min(stop, end)
    if hi <= lo and not (ev.terminal or ev.sample_end is not None):
        return None
    whole = end is None or end > stop  # text after the last token (a final flush) goes with what follows
    if lo == start and hi == stop and whole:
        return ev
    hi = max(lo, hi)
    a, b = lo - start, hi - start
    ca = ev.text_before(a)
    text = ev.text[ca : len(ev.text) if whole else ev.text_before(b)]
    marks = tuple((t - a, c - ca) for t, c in ev.marks if a < t < b)
    return replace(ev, index=lo, token_ids=ev.token_ids[a:b], text=text, logprobs=ev.logprobs[a:b], marks=marks)


def _window(ev: JobEvent, base: int, offset: int, end: int | None, usage_base: int | None = None) -> JobEvent | None:
    """``ev`` of an attempt that started at token ``base`` (of its sample), numbered as the caller's
    stream and cut to tokens [offset, end)."""
    return _cut(_shifted(ev, base, usage_base=usage_base) if base or usage_base else ev, offset, end)


def _spent_samples(req: GenerationRequest, streams: SampleCursors) -> list[JobEvent]:
    """The LENGTH ends of the samples whose whole max_tokens the caller has but whose end it did not
    get (their worker was lost after the last token); the last sample to end gets the terminal event,
    with every sample's tokens as usage."""
    most = req.sampling.max_tokens
    if most is None:
        return []
    spent = [k for k, c in streams.cursors.items() if k not in streams.ended and len(c.sent) >= most]
    live = streams.n - len(streams.ended) - len(spent)
    out = []
    for i, k in enumerate(spent):
        at = len(streams.cursors[k].sent)
        if live == 0 and i == len(spent) - 1:
            out.append(JobEvent(index=at, sample=k, finished=Finished(FinishReason.LENGTH, Usage(0, streams.total))))
        else:
            out.append(JobEvent(index=at, sample=k, sample_end=FinishReason.LENGTH))
    return out


def _check_in_range(request_id: str, end: JobEvent, base: int, offset: int, n: int) -> None:
    """Raise OutOfRange when an Attach asked for tokens past the end of what the request (or
    sample) produced: ``end`` ends it, after ``base`` tokens of earlier attempts."""
    produced = base + end.index + len(end.token_ids)
    if offset > produced:
        field, what = ("offset", "request") if n == 1 else (f"sample_offsets[{end.sample}]", f"sample {end.sample}")
        raise errors.OutOfRange(
            f"{field} {offset} is past the end of request {public_id(request_id)!r}: its {what} ended after "
            f"{produced} tokens"
        )


def _raise_failure(ev: JobEvent) -> None:
    if ev.failed is not None:
        f = ev.failed
        raise errors.from_code(f.code, f.message, f.field)


class Cursor:
    """The stream invariant for one caller: ``accept`` passes each token index once, in order."""

    duplicates_dropped = 0  # every cursor's, for the process (tests and logs read it)

    def __init__(self, sent: list[int] | None = None, offset: int = 0) -> None:
        self.sent = sent if sent is not None else []
        self.offset = offset  # the caller has tokens [0, offset) from elsewhere (an Attach)

    @property
    def next(self) -> int:
        return self.offset + len(self.sent)

    def accept(self, ev: JobEvent) -> JobEvent | None:
        """``ev`` (numbered as the caller's stream) less what the caller has; None if that is
        nothing. Raises EventsLost when it starts past the next index."""
        if ev.token_ids and ev.index > self.next:
            raise errors.EventsLost(
                f"the queue lost tokens {self.next}..{ev.index - 1} of this stream; retry the request"
            )
        if ev.token_ids and ev.index < self.next:
            Cursor.duplicates_dropped += 1
            log.warning("duplicate_tokens_dropped", index=ev.index, tokens=len(ev.token_ids), next=self.next)
            part = _cut(ev, self.next, None)
            if part is None:
                return None
            ev = part
        self.sent.extend(ev.token_ids)
        return ev


class SampleCursors:
    """The stream invariant for each sample of one caller's request (one for n == 1), and which
    samples have ended."""

    def __init__(self, n: int, offsets: Sequence[int] = ()) -> None:
        self.n = n
        self.cursors = {k: Cursor(offset=offsets[k] if k < len(offsets) else 0) for k in range(n)}
        self.ended: set[int] = set()
        self._only = self.cursors[0] if n == 1 else None  # the common case, on every event

    @property
    def total(self) -> int:
        """Tokens sent to the caller, every sample's."""
        if self._only is not None:
            return len(self._only.sent)
        return sum(len(c.sent) for c in self.cursors.values())

    def bases(self) -> tuple[int, ...]:
        """Tokens of each sample the caller has (an Attempt record's ``bases``), for n > 1."""
        return tuple(len(c.sent) for c in self.cursors.values()) if self.n > 1 else ()

    def accept(self, ev: JobEvent) -> JobEvent | None:
        """``ev`` (numbered as the caller's stream of its sample) less what the caller has; None if
        that is nothing. An end of a sample that already ended (a retried publish) is dropped; raises
        EventsLost for a gap, or for a sample this request does not have."""
        cursor = self._only if self._only is not None and not ev.sample else self.cursors.get(ev.sample)
        if cursor is None:
            raise errors.EventsLost(f"an event of sample {ev.sample} in a request of {self.n} sample(s)")
        if ev.sample_end is not None and not ev.terminal and ev.sample in self.ended:
            return None
        part = cursor.accept(ev)
        if part is not None and (part.sample_end is not None or part.finished is not None):
            self.ended.add(ev.sample)
        return part


class QueueRelay:
    """The relay over the queue (Redis Streams in production, MemoryQueue in tests)."""

    def __init__(
        self,
        queue: RelayQueue,
        settings: GatewaySettings,
        backends: Backends | None = None,
        policy: RoutingPolicy | None = None,
        queue_generation: Callable[[], int] = lambda: 0,
    ) -> None:
        self._queue = queue
        self._s = settings
        self._backends = backends
        self._policy = policy or RoutingPolicy(())
        self._queue_generation = queue_generation
        self._later: set[asyncio.Task[None]] = set()  # detach timers

    async def close(self) -> None:
        for t in list(self._later):
            t.cancel()
        await asyncio.gather(*self._later, return_exceptions=True)

    # --- generate

    async def generate(
        self, request: GenerationRequest, pool: str, progress: Progress, resumable: bool = False,
        caller: Caller | None = None,
    ) -> AsyncGenerator[JobEvent, None]:  # fmt: skip
        req = request
        who = caller or Caller()
        t0 = time.perf_counter()
        first_token_ns = 0
        target, chosen = self._policy.choose(req, pool, who.access)
        progress.route = chosen.text if chosen is not None else None
        streams = SampleCursors(req.sampling.samples)
        attempt: GenerationRequest | None = None
        submitted = finished = False
        attempts = deaths = 0
        failure: BaseException | None = None
        recorder: metrics.PoolRecorder | None = None
        last_token_at = 0.0
        try:
            while True:
                pool = self._backends.route(target) if self._backends else target
                pool = progress.pool = pool if who.access.allows(pool) else target  # no fallback it may not use
                if attempts and (ends := _spent_samples(req, streams)):
                    # Every token of these samples was sent before the worker was lost, only their
                    # end was missing: they end here (the last one ends the request).
                    for ev in ends:
                        finished = ev.terminal
                        streams.accept(ev)
                        progress.finish = FinishReason.LENGTH.value
                        yield ev
                    if finished:
                        return
                if attempts == 0:
                    attempt = req
                elif streams.n > 1:
                    attempt = resumed_samples(req, attempts, streams)
                else:
                    attempt = resumed(req, attempts, streams.cursors[0].sent)
                base = streams.total
                self._check_pool(pool)  # no worker came for a while: say so now, not at the deadline
                self._check_reachable(pool, req.deadline_unix_ns)
                record = Attempt(attempt.request_id, base, pool, req.model, req.accepted_unix_ns, resumable,
                                 who.fingerprint, streams.bases(), tuple(sorted(streams.ended)))  # fmt: skip
                if not await self._queue.begin(req.request_id, record, first=attempts == 0):
                    # This request id was accepted before: a retry after a lost reply (one job, so
                    # follow the one there is), or another request under a taken id (refused).
                    await self._same_request(req.request_id, who.fingerprint)
                    log.info("request_retried", request_id=req.request_id)
                    async for _head, ev in self.attach(req.request_id, 0, count=False):
                        streams.accept(ev)
                        yield ev
                    finished = True
                    return
                try:
                    await self._queue.submit(pool, attempt, max_waiting=self._s.max_queue, weight=who.weight)
                except errors.QueueFull as exc:
                    metrics.rejected(exc)
                    if attempts == 0:
                        await self._queue.forget(req.request_id)
                    raise errors.QueueFull(exc.message, retry_after_s=self._s.retry_after_s) from None
                except errors.QueueUnavailable:
                    # Queued or not (a lost reply): the caller's retry must not find an attempt
                    # record and wait on a job that may never have been queued. Without the record
                    # it submits again, and a submission that did land is not queued twice (its
                    # submitted marker); so the record goes, if Redis lets it.
                    if attempts == 0:
                        with contextlib.suppress(errors.QueueUnavailable):
                            await self._queue.forget(req.request_id)
                    raise
                submitted, finished = True, False
                tracing.event("job_submitted", pool=pool, job=attempt.request_id, attempt=attempts)
                if recorder is None or recorder.pool != pool:
                    recorder = metrics.pool_recorder(pool)
                try:
                    async for raw in self._watched(pool, attempt):
                        finished = raw.terminal
                        _raise_failure(raw)
                        if base:
                            raw = _shifted(raw, record.base_of(raw.sample), first_token_ns, usage_base=base)
                        accepted = streams.accept(raw)
                        total = streams.total
                        if self._backends is not None and total > progress.tokens:
                            self._backends.count_tokens(pool, total - progress.tokens)
                        progress.tokens = total
                        if accepted is None:
                            continue
                        ev = accepted
                        if ev.token_ids:
                            now = time.perf_counter()
                            if progress.ttft_ms is None:
                                progress.ttft_ms = round((now - t0) * 1000, 2)
                                first_token_ns = time.time_ns()
                                recorder.ttft.observe(now - t0)
                                tracing.event("first_token", ttft_ms=progress.ttft_ms)
                            else:
                                recorder.itl.observe(now - last_token_at)
                            last_token_at = now
                        if ev.ends_sample is not None:
                            progress.finish = ev.ends_sample.value
                        if ev.finished is not None:
                            recorder.prompt.inc(ev.finished.usage.prompt_tokens)
                            self._observe_wait(pool, attempt, ev.finished, attempts)
                        yield ev
                        if finished:
                            return
                except (errors.WorkerLost, errors.EngineDead, errors.EventsLost) as exc:
                    # Lost events are Redis's doing: the attempt is abandoned and the request
                    # resumed from what the caller has, like a lost worker, but nobody died.
                    deaths += isinstance(exc, errors.EngineDead) or (isinstance(exc, errors.WorkerLost) and exc.running)
                    await self._give_up_or_fail_over(pool, req, attempt, attempts, deaths, exc, streams.total)
                    tracing.event("failover", pool=pool, error=exc.code, tokens=streams.total)
                    attempts = progress.failovers = attempts + 1
                    submitted = False
        except BaseException as exc:  # recorded for the pool, and to tell a caller gone from an error
            failure = exc
            raise
        finally:
            if recorder is not None and streams.total:
                recorder.generated.inc(streams.total)
            if submitted and not finished and attempt is not None:
                gone = failure is None or isinstance(failure, asyncio.CancelledError | GeneratorExit)
                if resumable and gone:  # the caller's connection dropped: it may Attach again
                    tracing.event("detached", job=attempt.request_id)
                    await asyncio.shield(self._detached(req.request_id, attempt.request_id))
                else:  # disconnect, deadline or a failed read: the worker must stop generating
                    gone_at = time.perf_counter()
                    tracing.event("job_cancelled", job=attempt.request_id)
                    await asyncio.shield(self._cancel(attempt.request_id))
                    if gone:
                        metrics.DISCONNECT_CANCEL.observe(time.perf_counter() - gone_at)
            if self._backends is not None and progress.pool and (submitted or failure is not None):
                # The caller going away (GeneratorExit: it stopped reading) is its doing, not the pool's.
                outcome = asyncio.CancelledError() if isinstance(failure, GeneratorExit) else failure
                await asyncio.shield(self._backends.record(progress.pool, outcome))

    async def _give_up_or_fail_over(
        self, pool: str, req: GenerationRequest, attempt: GenerationRequest, attempts: int, deaths: int,
        exc: errors.WorkerLost | errors.EngineDead | errors.EventsLost, sent: int,
    ) -> None:  # fmt: skip
        """Raise when the request goes no further (set aside, or out of attempts); else cancel the
        lost attempt (a worker that comes back skips it) and count the failure against the pool."""
        if self._s.max_worker_deaths and deaths >= self._s.max_worker_deaths:
            # A poison request: the workers running it keep dying; no third one.
            await self._set_aside(pool, req, deaths, exc)
            raise errors.SetAside(
                f"the request was set aside: {deaths} workers died running it, so it is not sent to "
                f"another; it is recorded in pool {pool!r}'s dead-letter stream"
            ) from exc
        if self._backends is None or attempts >= self._s.failover_attempts:
            if attempts:  # it outlived every worker it was sent to: keep it for inspection
                await self._set_aside(pool, req, attempts + 1, exc)
            raise exc
        if not isinstance(exc, errors.EventsLost):
            await self._backends.record(pool, exc)
        await asyncio.shield(self._cancel(attempt.request_id))
        metrics.FAILOVERS.labels(pool).inc()
        log.warning("request_failed_over", pool=pool, error=str(exc), attempt=attempts + 1,
                    resumed_tokens=sent)  # fmt: skip

    async def _same_request(self, request_id: str, fingerprint: str) -> None:
        """Raise AlreadyExists unless the request first accepted under ``request_id`` is this one."""
        records = await self._queue.attempts(request_id)
        first = records[0].fingerprint if records else ""
        if fingerprint and first and first != fingerprint:
            raise errors.AlreadyExists(
                f"request id {public_id(request_id)!r} names another request; retry it unchanged to "
                "attach to it, or use a new id"
            )

    def _observe_wait(self, pool: str, attempt: GenerationRequest, f: Finished, attempts: int) -> None:
        if f.started_unix_ns and not attempts:
            wait_s = max(0, f.started_unix_ns - attempt.accepted_unix_ns) / 1e9
            if attempt.accepted_unix_ns:
                metrics.QUEUE_WAIT.labels(pool).observe(wait_s)
            if self._backends is not None:
                self._backends.observe_queue_wait(pool, wait_s)

    async def _watched(self, pool: str, attempt: GenerationRequest) -> AsyncIterator[JobEvent]:
        """The attempt's events; every probe interval without one, check that its worker is still alive
        (or, before any worker took it, that its pool can still serve it better than the fallback).
        Otherwise raise WorkerLost, after which the request may go elsewhere."""
        backends = self._backends
        # One read of the events with an idle signal, not a task and a timed wait per event: at one
        # event per token per stream that was a tenth of the gateway's CPU (docs/benchmarks.md).
        idle_s = backends.check_interval_s if backends is not None else 1.0
        events = self._queue.events_within(attempt.request_id, idle_s)
        worker = ""
        generation = self._queue_generation()
        try:
            async for item in events:
                if self._queue_generation() != generation:  # its events and job may be gone: never wait on
                    raise errors.QueueUnavailable("Redis came back without its data: this request was lost")
                if item is None:  # nothing for idle_s
                    if backends is not None and worker and not backends.worker_alive(pool, worker):
                        raise errors.WorkerLost(f"worker {worker!r} of pool {pool!r} stopped answering", running=True)
                    if backends is not None and not worker and backends.stranded(pool):
                        raise errors.WorkerLost(f"pool {pool!r} cannot serve; its fallback can")
                    if not worker:
                        self._check_pool(pool)
                    continue
                ev = item[1]
                worker = ev.worker or worker
                yield ev
                if ev.terminal:
                    return
            raise errors.WorkerLost("the event stream ended without a terminal event")
        finally:
            await events.aclose()

    def _check_pool(self, pool: str) -> None:
        """Raise NoWorkers (with what its workers say) when the pool had nobody for
        ``no_worker_wait_s``, or has been starting for ``start_wait_s``."""
        b, s = self._backends, self._s
        if b is None:
            return
        if s.no_worker_wait_s > 0 and b.empty_for(pool) > s.no_worker_wait_s:
            why = f"has had no live worker for {s.no_worker_wait_s:g} s"
        elif s.start_wait_s > 0 and b.starting_for(pool) > s.start_wait_s:
            why = f"has been starting for over {s.start_wait_s:g} s"
        else:
            return  # the common case, checked every interval while a request waits: no strings built
        wrong = b.what_is_wrong(pool)
        raise errors.NoWorkers(f"pool {pool!r} {why}" + (f" ({wrong})" if wrong else ""))

    def _check_reachable(self, pool: str, deadline_unix_ns: int) -> None:
        """Refuse at once a request that would wait in the queue past its deadline."""
        if not deadline_unix_ns or self._backends is None:
            return
        wait = self._backends.expected_queue_wait(pool)
        remaining_s = (deadline_unix_ns - time.time_ns()) / 1e9
        if wait > 0 and remaining_s < wait:
            raise errors.DeadlineUnreachable(
                f"the deadline ({remaining_s:.3f} s) is shorter than pool {pool!r}'s queue wait ({wait:.3f} s)"
            )

    async def _set_aside(self, pool: str, req: GenerationRequest, deliveries: int, exc: BaseException) -> None:
        try:
            await self._queue.set_aside(pool, req, f"{deliveries} workers were lost running it: {exc}", deliveries)
            metrics.DEAD_LETTERS.labels(pool).inc()
        except errors.QueueUnavailable:
            log.warning("set_aside_failed", request_id=req.request_id)

    # --- detach, attach

    async def _detached(self, caller_id: str, attempt_id: str) -> None:
        """A resumable request lost its caller: cancel it after the re-attach grace unless someone
        attached meanwhile (the count of attaches moved)."""
        try:
            seen = await self._queue.attach_count(caller_id)
        except errors.QueueUnavailable:
            seen = -1
        log.info("request_detached", request_id=caller_id, grace_s=self._s.reattach_grace_s)

        async def later() -> None:
            await asyncio.sleep(self._s.reattach_grace_s)
            try:
                if await self._queue.attach_count(caller_id) == seen:
                    log.info("request_detach_expired", request_id=caller_id)
                    await self._cancel(attempt_id)
            except errors.QueueUnavailable:
                await self._cancel(attempt_id)

        task = asyncio.create_task(later(), name=f"detached-{caller_id}")
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def attach(
        self, request_id: str, offset: int, count: bool = True, sample_offsets: Sequence[int] = ()
    ) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        """The caller's request from token ``offset`` on (n > 1: from ``sample_offsets``, and
        ``offset`` must be 0), through its attempts in order: what each abandoned attempt had sent
        (up to the next one's start), then the last one followed to its end. Raises NotFound for an
        unknown (or expired) id. ``count``: a re-attach (it stops a detach timer); a retried
        Generate following its own request is not one."""
        records = await self._queue.attempts(request_id)
        if not records:
            raise errors.NotFound(f"no request {public_id(request_id)!r} (unknown, or its events expired)")
        n = max(len(records[0].bases), 1)
        if n > 1 and offset:
            raise errors.InvalidRequest.field(
                "offset", f"this request has {n} samples: give what you have of each in sample_offsets"
            )
        streams = SampleCursors(n, list(sample_offsets) if n > 1 else [offset or next(iter(sample_offsets), 0)])
        if count:
            await self._queue.attach(request_id)
            log.info("request_attached", request_id=request_id, offset=offset, sample_offsets=list(sample_offsets))
        try:
            for i, rec in enumerate(records):
                head = GenerationRequest(request_id=request_id, model=rec.model, accepted_unix_ns=rec.accepted_unix_ns)
                if i + 1 < len(records):  # abandoned at the next one's start: read what it had, no terminal
                    later = records[i + 1]
                    for _id, ev in await self._queue.read_events(rec.attempt_id):
                        k = ev.sample
                        # A sample's end counts only if the next attempt knew it had ended.
                        ev = replace(ev, finished=None, failed=None,
                                     sample_end=ev.ends_sample if k in later.ended else None)  # fmt: skip
                        cursor = streams.cursors.get(k)
                        part = _window(ev, rec.base_of(k), cursor.next, later.base_of(k)) if cursor else None
                        if part is not None and (part := streams.accept(part)) is not None:
                            yield head, part
                    continue
                job = GenerationRequest(request_id=rec.attempt_id, model=rec.model)
                async for ev in self._watched(rec.pool, job):
                    _raise_failure(ev)
                    cursor = streams.cursors.get(ev.sample)
                    if cursor is not None and ev.ends_sample is not None:
                        _check_in_range(request_id, ev, rec.base_of(ev.sample), cursor.next, n)
                    part = _window(ev, rec.base_of(ev.sample), cursor.next if cursor else 0, None, rec.base)
                    if part is not None and (part := streams.accept(part)) is not None:
                        yield head, part
        except (asyncio.CancelledError, GeneratorExit):
            if count and records[-1].resumable:  # dropped again: the same grace as the first time
                await asyncio.shield(self._detached(request_id, records[-1].attempt_id))
            raise

    # --- cancel, tokenize

    async def _cancel(self, request_id: str) -> None:
        try:
            await self._queue.cancel(request_id)
        except errors.QueueUnavailable:
            log.warning("cancel_failed", request_id=request_id)

    async def cancel(self, request_id: str) -> None:
        await self._queue.call_off(request_id)
        records = await self._queue.attempts(request_id)
        if records and not await self._queue.read_events(records[-1].attempt_id):
            # Still queued: its stream ends now (the worker that reaches the job skips it).
            last = records[-1]
            now = time.time_ns()
            ended = JobEvent(index=last.base_of(0), finished=Finished(FinishReason.CANCELLED, Usage(0, last.base), now))
            await self._queue.end(last.attempt_id, ended)
        log.info("request_cancel_requested", request_id=request_id)

    async def tokenize(self, request: GenerationRequest, pool: str) -> JobEvent:
        await self._queue.submit(pool, request)
        async for _eid, ev in self._queue.events(request.request_id):
            _raise_failure(ev)
            if ev.terminal:
                return ev
        raise errors.WorkerLost("the worker ended without an answer")
