"""Running one leased job: engine deltas -> events, ending with exactly one terminal event."""

from __future__ import annotations

import asyncio
import time

import structlog

from llamamesh import metrics, tracing
from llamamesh.errors import DeadlineExceeded, EngineDead, InternalError, LlamameshError, WorkerLost, field_of
from llamamesh.queue.protocol import Lease
from llamamesh.types import (
    Failure,
    Finished,
    FinishReason,
    JobEvent,
    JobKind,
    Usage,
)
from workers.outbox import Outbox
from workers.samples import Samples

log = structlog.get_logger(__name__)

# Request ids of the gateways' probes (services/backends.py) start with it ("~" is in no caller's id).
PROBE_PREFIX = "probe~"


def failure_of(exc: LlamameshError) -> Failure:
    return Failure(code=exc.code, message=exc.message, retryable=exc.retryable, field=field_of(exc))


def cancelled_event(lease: Lease, worker: str) -> JobEvent:
    now = time.time_ns()
    return JobEvent(
        worker=worker,
        finished=Finished(FinishReason.CANCELLED, Usage(0, 0), started_unix_ns=now),
    )


async def run_job(
    lease: Lease, engine: Samples, outbox: Outbox, worker: str, stopping: asyncio.Event | None = None
) -> None:
    """Drive the engine for one job and publish its events.

    The terminal event (finished or failed) is published under ``shield``, so a
    cancelled job task still leaves one terminal event and an acked job. Raises
    EngineDead after publishing, so the worker can stop.
    """
    req = lease.request
    started = time.time_ns()
    first_token = 0
    index = 0  # tokens generated, every sample's
    at: dict[int, int] = {}  # each sample's next token index
    # The samples still to end (n > 1: each ends on its own; the last one's end is the terminal event).
    left = set(req.resume_samples) or set(range(req.sampling.samples))
    prompt_tokens = 0
    terminal: JobEvent | None = None
    engine_timings: tuple[tuple[str, float], ...] = ()
    dead: EngineDead | None = None
    structlog.contextvars.bind_contextvars(request_id=req.request_id)
    traced = tracing.JobSpan(req.trace, req.accepted_unix_ns, started, **{
        "llamamesh.request_id": req.request_id, "llamamesh.pool": lease.pool, "llamamesh.worker": worker,
        "llamamesh.kind": req.kind.value})  # fmt: skip
    timer: asyncio.TimerHandle | None = None
    probe = req.request_id.startswith(PROBE_PREFIX)  # the gateways' health probes: not counted as jobs
    if not probe:
        metrics.JOBS_STARTED.labels(lease.pool).inc()
    generated = metrics.WORKER_TOKENS.labels(lease.pool)
    try:
        if req.deadline_unix_ns:
            left_s = (req.deadline_unix_ns - started) / 1e9
            if left_s <= 0:  # its caller gave up while it queued: never run it
                raise DeadlineExceeded(f"the request's deadline passed {-left_s:.3f} s before a worker took it")
            # At the deadline the engine aborts it (the slot frees even if no gateway cancels it).
            timer = asyncio.get_running_loop().call_later(left_s, _abort_soon, engine, req.request_id)
        if req.kind is JobKind.TOKENIZE:
            ids = await engine.tokenize(req)
            terminal = JobEvent(token_ids=tuple(ids), tokenized=True, worker=worker)
            return
        outbox.watch(lease)
        async for delta in engine.stream(req):
            if delta.token_ids:
                if not probe:
                    generated.inc(len(delta.token_ids))
                if not first_token:
                    first_token = time.time_ns()
            if delta.finish_reason is FinishReason.CANCELLED and 0 < req.deadline_unix_ns <= time.time_ns():
                raise DeadlineExceeded(f"aborted at the request's deadline after {index} tokens")
            if delta.finish_reason is FinishReason.CANCELLED and stopping is not None and stopping.is_set():
                # Aborted by this worker's drain, not by its caller: hand it back. The gateway takes
                # worker_lost for a lost worker and resumes the stream elsewhere from these tokens.
                raise WorkerLost(f"worker {worker!r} stopped after {index} tokens; handed back")
            k = delta.sample
            start = at.get(k, 0)
            at[k] = start + len(delta.token_ids)
            index += len(delta.token_ids)
            prompt_tokens = delta.prompt_tokens or prompt_tokens
            if delta.finish_reason is None:
                if delta.token_ids or delta.text:
                    outbox.add(lease, JobEvent(delta.text, delta.token_ids, start, delta.logprobs, worker=worker,
                                               sample=k))  # fmt: skip
                continue
            left.discard(k)
            if left and delta.finish_reason is not FinishReason.CANCELLED:
                # One sample of several ended; the others go on.
                outbox.add(lease, JobEvent(delta.text, delta.token_ids, start, delta.logprobs, worker=worker,
                                           sample=k, sample_end=delta.finish_reason))  # fmt: skip
                continue
            engine_timings = delta.engine_timings_ms
            terminal = JobEvent(
                text=delta.text,
                token_ids=delta.token_ids,
                index=start,
                logprobs=delta.logprobs,
                worker=worker,
                sample=k,
                finished=Finished(
                    finish_reason=delta.finish_reason,
                    usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=index),
                    started_unix_ns=started,
                    first_token_unix_ns=first_token,
                ),
            )
            return
        terminal = JobEvent(worker=worker, failed=failure_of(InternalError("the engine ended without finishing")))
    except asyncio.CancelledError:
        if stopping is not None and stopping.is_set():  # the worker gives it up: another one resumes it
            lost = WorkerLost(f"worker {worker!r} stopped after {index} tokens; handed back")
            terminal = JobEvent(worker=worker, failed=failure_of(lost))
        else:
            terminal = JobEvent(
                worker=worker,
                finished=Finished(FinishReason.CANCELLED, Usage(0, index), started, first_token),
            )
        raise
    except EngineDead as exc:
        log.error("engine_dead", error=str(exc))
        dead = exc
        terminal = JobEvent(worker=worker, failed=failure_of(exc))
    except LlamameshError as exc:
        terminal = JobEvent(worker=worker, failed=failure_of(exc))
    except Exception:
        log.exception("job_crashed")
        terminal = JobEvent(worker=worker, failed=failure_of(InternalError("internal error")))
    finally:
        if timer is not None:
            timer.cancel()
        if terminal is not None:
            await asyncio.shield(outbox.finish(lease, terminal))
            _log_finished(lease, terminal, started, first_token, engine_timings, probe)
        traced.end(_outcome(terminal), first_token)
        structlog.contextvars.unbind_contextvars("request_id")
    if dead is not None:
        raise dead


def _outcome(event: JobEvent | None) -> str:
    """How a job ended, for its span: ok, cancelled or the failure's code."""
    if event is None:
        return "internal"
    if event.failed is not None:
        return event.failed.code
    cancelled = event.finished is not None and event.finished.finish_reason is FinishReason.CANCELLED
    return "cancelled" if cancelled else "ok"


def _abort_soon(engine: Samples, request_id: str) -> None:
    task = asyncio.ensure_future(engine.abort(request_id))
    _aborts.add(task)  # keep a reference until it is done
    task.add_done_callback(_aborts.discard)


_aborts: set[asyncio.Future[None]] = set()


def _log_finished(
    lease: Lease, event: JobEvent, started: int, first_token: int, engine_timings: tuple[tuple[str, float], ...],
    probe: bool = False,
) -> None:
    req = lease.request
    fields: dict[str, object] = {
        "kind": req.kind.value,
        "model": req.model,
        "queue_wait_ms": round((started - req.accepted_unix_ns) / 1e6, 2) if req.accepted_unix_ns else None,
        "duration_ms": round((time.time_ns() - started) / 1e6, 2),
    }
    if event.finished is not None:
        f = event.finished
        fields.update(
            status="ok",
            finish_reason=f.finish_reason.value,
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            ttft_ms=round((first_token - req.accepted_unix_ns) / 1e6, 2)
            if first_token and req.accepted_unix_ns
            else None,
            **{f"{name}_ms": ms for name, ms in engine_timings},
        )
    elif event.failed is not None:
        fields.update(status=event.failed.code, error=event.failed.message)
    else:
        fields.update(status="ok")
    log.info("job_finished", **fields)
    if probe:
        return
    cancelled = event.finished is not None and event.finished.finish_reason is FinishReason.CANCELLED
    metrics.JOBS_FINISHED.labels(lease.pool, "cancelled" if cancelled else str(fields["status"])).inc()
