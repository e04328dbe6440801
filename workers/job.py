"""One leased job run on the engine: its deltas become events, and it ends with exactly one terminal
event (finished or failed), published under ``shield``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import structlog

from llamamesh import metrics, tracing
from llamamesh.errors import DeadlineExceeded, EngineDead, InternalError, LlamameshError, field_of
from llamamesh.queue.protocol import Lease
from llamamesh.types import Failure, Finished, FinishReason, JobEvent, JobKind, TokenDelta, Usage
from workers.carry_on import Carried
from workers.samples import Samples

log = structlog.get_logger(__name__)

# Request ids of the gateways' probes (services/backends.py) start with it ("~" is in no caller's id).
PROBE_PREFIX = "probe~"


def failure_of(exc: LlamameshError) -> Failure:
    return Failure(code=exc.code, message=exc.message, retryable=exc.retryable, field=field_of(exc))


def cancelled_event(lease: Lease, worker: str) -> JobEvent:
    """The terminal event of a job cancelled before it ran."""
    finished = Finished(FinishReason.CANCELLED, Usage(0, 0), started_unix_ns=time.time_ns())
    return JobEvent(worker=worker, finished=finished)


class EventSink(Protocol):
    """Where a job's events go: the worker's Outbox (workers/outbox.py)."""

    def watch(self, lease: Lease) -> None: ...

    def add(self, lease: Lease, event: JobEvent) -> None: ...

    async def finish(self, lease: Lease, event: JobEvent) -> None: ...


class Job:
    """One job from its lease to its terminal event.

    Invariants: each sample's events carry contiguous token indexes from 0 (from where its stream
    stood, for a job carried on from a dead worker's: workers/carry_on.py); a sample of several that
    ends while others go on says so (``sample_end``); the job publishes exactly one terminal event,
    whether it finishes, fails, is cancelled or its engine dies; with ``n`` > 1 (workers/samples.py
    merges the samples' deltas) the last sample to end ends the job.
    """

    def __init__(
        self,
        lease: Lease,
        engine: Samples,
        events: EventSink,
        worker: str,
        stopping: asyncio.Event | None = None,
        first_token: Callable[[float], None] | None = None,
        carried: Carried | None = None,
    ) -> None:
        """``stopping``: set by the worker's drain once its grace ran out; a job it aborts or cancels
        then ends worker_lost (handed back), not cancelled. ``first_token``: told the seconds from
        the gateway's acceptance to the first token of a generation that is not a probe (adaptive
        batch admission's signal)."""
        self._on_first_token = first_token
        self.lease = lease
        self.request = lease.request
        self._engine = engine
        self._events = events
        self.worker = worker
        self._stopping = stopping
        self.started = time.time_ns()
        self.first_token = 0
        self.generated = carried.generated if carried else 0  # tokens on its stream, every sample's
        self._next: dict[int, int] = dict(carried.next_index) if carried else {}  # each sample's next token index
        # The samples still to end (n > 1: each ends on its own; the last one's end is the terminal event).
        self._left = set(self.request.resume_samples) or set(range(self.request.sampling.samples))
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._engine_timings: tuple[tuple[str, float], ...] = ()
        self.terminal: JobEvent | None = None
        self.probe = self.request.request_id.startswith(PROBE_PREFIX)  # the gateways' probes: not counted
        self._tokens = metrics.WORKER_TOKENS.labels(lease.pool)

    async def run(self) -> None:
        """Drive the engine and publish the job's events. The last event is published under
        ``shield``, so a cancelled job still leaves one last event (terminal and acked, or a
        hand-back). When the engine dies under it, the job is handed back (another worker carries it
        on) and EngineDead raised after publishing, so that the worker stops; re-raises
        CancelledError."""
        req = self.request
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        span = tracing.JobSpan(
            req.trace,
            req.accepted_unix_ns,
            self.started,
            {
                "llamamesh.request_id": req.request_id,
                "llamamesh.pool": self.lease.pool,
                "llamamesh.worker": self.worker,
                "llamamesh.kind": req.kind.value,
            },
            traced=not self.probe,
        )
        if not self.probe:
            metrics.JOBS_STARTED.labels(self.lease.pool).inc()
        timer: asyncio.TimerHandle | None = None
        dead: EngineDead | None = None
        try:
            timer = self._arm_deadline()
            self.terminal = await (self._tokenize() if req.kind is JobKind.TOKENIZE else self._generate())
        except asyncio.CancelledError:
            self.terminal = self.cancelled()
            raise
        except _HandBack:
            self.terminal = self.handed_back()
        except EngineDead as exc:
            log.error("engine_dead", error=str(exc))
            dead, self.terminal = exc, self.handed_back(engine_died=True)
        except LlamameshError as exc:
            self.terminal = self.failed(exc)
        except Exception:
            log.exception("job_crashed")
            self.terminal = self.failed(InternalError("internal error"))
        finally:
            if timer is not None:
                timer.cancel()
            await self._publish_terminal()
            span.end(_outcome(self.terminal), self.first_token)
            structlog.contextvars.unbind_contextvars("request_id")
        if dead is not None:
            raise dead

    def _arm_deadline(self) -> asyncio.TimerHandle | None:
        """At the request's deadline the engine aborts it (the slot frees even if no gateway cancels
        it). DeadlineExceeded if it passed while the job queued: it never runs."""
        deadline = self.request.deadline_unix_ns
        if not deadline:
            return None
        left_s = (deadline - self.started) / 1e9
        if left_s <= 0:
            raise DeadlineExceeded(f"the request's deadline passed {-left_s:.3f} s before a worker took it")
        return asyncio.get_running_loop().call_later(left_s, _abort_soon, self._engine, self.request.request_id)

    async def _tokenize(self) -> JobEvent:
        ids = await self._engine.tokenize(self.request)
        return JobEvent(token_ids=tuple(ids), tokenized=True, worker=self.worker)

    async def _generate(self) -> JobEvent:
        self._events.watch(self.lease)
        async for delta in self._engine.stream(self.request):
            terminal = self.on_delta(delta)
            if terminal is not None:
                return terminal
        return self.failed(InternalError("the engine ended without finishing"))

    def on_delta(self, delta: TokenDelta) -> JobEvent | None:
        """Take one engine delta: a non-terminal event goes to the sink at once; the event that ends
        the job is returned (to publish once). Raises DeadlineExceeded or WorkerLost for an abort
        that was the deadline's or the drain's rather than the caller's."""
        self._count(delta)
        self._check_abort(delta)
        k = delta.sample
        start = self._next.get(k, 0)
        self._next[k] = start + len(delta.token_ids)
        self.generated += len(delta.token_ids)
        self._prompt_tokens = delta.prompt_tokens or self._prompt_tokens
        self._cached_tokens = delta.cached_tokens or self._cached_tokens
        event = JobEvent(delta.text, delta.token_ids, start, delta.logprobs, worker=self.worker, sample=k)
        if delta.finish_reason is None:
            if delta.token_ids or delta.text:
                self._events.add(self.lease, event)
            return None
        self._left.discard(k)
        if self._left and delta.finish_reason is not FinishReason.CANCELLED:
            # One sample of several ended; the others go on.
            self._events.add(self.lease, replace(event, sample_end=delta.finish_reason))
            return None
        self._engine_timings = delta.engine_timings_ms
        usage = Usage(self._prompt_tokens, self.generated, self._cached_tokens)
        return replace(event, finished=Finished(delta.finish_reason, usage, self.started, self.first_token))

    def _count(self, delta: TokenDelta) -> None:
        if not delta.token_ids:
            return
        if not self.probe:
            self._tokens.inc(len(delta.token_ids))
        if not self.first_token:
            self.first_token = time.time_ns()
            accepted = self.request.accepted_unix_ns
            if self._on_first_token is not None and accepted and not self.probe and not self.request.resume_token_ids:
                self._on_first_token((self.first_token - accepted) / 1e9)

    def _check_abort(self, delta: TokenDelta) -> None:
        if delta.finish_reason is not FinishReason.CANCELLED:
            return
        if 0 < self.request.deadline_unix_ns <= time.time_ns():
            raise DeadlineExceeded(f"aborted at the request's deadline after {self.generated} tokens")
        if self._stopping is not None and self._stopping.is_set():
            # Aborted by this worker's drain, not by its caller: hand it back. A gateway following it
            # moves it to another worker at once; else the worker that claims it carries it on.
            raise _HandBack

    def cancelled(self) -> JobEvent:
        """The last event of a job whose task was cancelled: handed back when the worker gives it up;
        else its terminal event, cancelled, with the tokens made."""
        if self._stopping is not None and self._stopping.is_set():
            return self.handed_back()
        finished = Finished(FinishReason.CANCELLED, Usage(0, self.generated), self.started, self.first_token)
        return JobEvent(worker=self.worker, finished=finished)

    def handed_back(self, engine_died: bool = False) -> JobEvent:
        """The last event of a job this worker gives up unfinished (``engine_died``: its engine died
        under it): not terminal, its lease not acked, so another worker goes on with it from its
        stream (workers/carry_on.py)."""
        log.info("job_handed_back", tokens=self.generated, engine_died=engine_died)
        return JobEvent(worker=self.worker, handed_back=True, engine_died=engine_died)

    def failed(self, exc: LlamameshError) -> JobEvent:
        return JobEvent(worker=self.worker, failed=failure_of(exc))

    async def _publish_terminal(self) -> None:
        if self.terminal is None:
            return
        await asyncio.shield(self._events.finish(self.lease, self.terminal))
        self._log_finished(self.terminal)

    def _log_finished(self, event: JobEvent) -> None:
        """The job's canonical line, job_finished, and its count in llamamesh_jobs_finished_total."""
        req = self.request
        fields: dict[str, object] = {
            "kind": req.kind.value,
            "model": req.model,
            "queue_wait_ms": _ms(self.started - req.accepted_unix_ns) if req.accepted_unix_ns else None,
            "duration_ms": _ms(time.time_ns() - self.started),
        }
        if event.finished is not None:
            f = event.finished
            ttft = _ms(self.first_token - req.accepted_unix_ns) if self.first_token and req.accepted_unix_ns else None
            fields.update(
                status="ok",
                finish_reason=f.finish_reason.value,
                prompt_tokens=f.usage.prompt_tokens,
                completion_tokens=f.usage.completion_tokens,
                ttft_ms=ttft,
                **{f"{name}_ms": ms for name, ms in self._engine_timings},
            )
        elif event.failed is not None:
            fields.update(status=event.failed.code, error=event.failed.message)
        elif event.handed_back:
            fields.update(status="handed_back")
        else:
            fields.update(status="ok")
        (log.debug if self.probe else log.info)("job_finished", **fields)  # (the gateways' probes: every second)
        if not self.probe:
            status = "cancelled" if _outcome(event) == "cancelled" else str(fields["status"])
            metrics.JOBS_FINISHED.labels(self.lease.pool, status).inc()


class _HandBack(Exception):
    """The engine aborted the job for this worker's drain: it is handed back, not ended."""


def _ms(ns: int) -> float:
    return round(ns / 1e6, 2)


def _outcome(event: JobEvent | None) -> str:
    """How a job ended, for its span: ok, cancelled or the failure's code."""
    if event is None:
        return "internal"
    if event.failed is not None:
        return event.failed.code
    if event.handed_back:
        return "handed_back"
    cancelled = event.finished is not None and event.finished.finish_reason is FinishReason.CANCELLED
    return "cancelled" if cancelled else "ok"


def _abort_soon(engine: Samples, request_id: str) -> None:
    task = asyncio.ensure_future(engine.abort(request_id))
    _aborts.add(task)  # keep a reference until it is done
    task.add_done_callback(_aborts.discard)


_aborts: set[asyncio.Future[None]] = set()
