"""GenerationService: validate, enqueue, relay the worker's events to the caller."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import grpc
import structlog

from llamamesh import errors
from llamamesh.queue.protocol import JobQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import Attempt, Finished, FinishReason, GenerationRequest, JobEvent, ModelInfo, Usage
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services import convert, status
from services.backends import Backends
from services.routing import RoutingPolicy

log = structlog.get_logger(__name__)


def resumed(req: GenerationRequest, n: int, sent: Sequence[int]) -> GenerationRequest:
    """Attempt ``n`` of ``req`` after ``sent`` tokens reached the caller: it feeds them after the
    input and generates only the rest of the budget."""
    if not sent:
        return replace(req, request_id=f"{req.request_id}.{n}", origin_id=req.request_id)
    s = req.sampling
    return replace(
        req,
        request_id=f"{req.request_id}.{n}",
        origin_id=req.request_id,
        resume_token_ids=tuple(sent),
        sampling=replace(
            s,
            max_tokens=None if s.max_tokens is None else s.max_tokens - len(sent),
            min_tokens=None if s.min_tokens is None else max(0, s.min_tokens - len(sent)),
        ),
    )


def _shifted(ev: JobEvent, base: int, first_token_ns: int) -> JobEvent:
    """An event of a resumed attempt as the caller's stream numbers it: ``base`` tokens came before."""
    f = ev.finished
    if f is not None:
        f = replace(
            f,
            usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens + base),
            first_token_unix_ns=first_token_ns or f.first_token_unix_ns,
        )
    return replace(ev, index=ev.index + base, finished=f)


def _length_reached(n_tokens: int) -> JobEvent:
    return JobEvent(finished=Finished(FinishReason.LENGTH, Usage(0, n_tokens)))


def _window(ev: JobEvent, base: int, offset: int, end: int | None) -> JobEvent | None:
    """``ev`` of an attempt that started at token ``base``, numbered as the caller's stream and cut
    to tokens [offset, end): None if nothing of it is left. Cutting inside an event keeps its token
    ids but not its text (text does not split by token); offsets a caller got as a count of the
    messages it received never cut inside one."""
    ev = _shifted(ev, base, 0) if base else ev
    start, stop = ev.index, ev.index + len(ev.token_ids)
    lo, hi = max(start, offset), stop if end is None else min(stop, end)
    if ev.terminal:
        return replace(ev, index=lo, token_ids=ev.token_ids[lo - start : max(lo, hi) - start],
                       text=ev.text if lo == start else "", logprobs=ev.logprobs[lo - start :])  # fmt: skip
    if hi <= lo:
        return None
    if (lo, hi) == (start, stop):
        return ev
    text = ev.text if lo == start and hi == stop else ""
    return replace(ev, index=lo, token_ids=ev.token_ids[lo - start : hi - start], text=text,
                   logprobs=ev.logprobs[lo - start : hi - start])  # fmt: skip


def _raise_failure(ev: JobEvent) -> None:
    if ev.failed is not None:
        f = ev.failed
        raise errors.from_code(f.code, f.message, f.field)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        queue: JobQueue,
        settings: GatewaySettings,
        models: Sequence[ModelInfo],
        backends: Backends | None = None,
        policy: RoutingPolicy | None = None,
        queue_generation: Callable[[], int] = lambda: 0,
    ) -> None:
        self._queue = queue
        self._queue_generation = queue_generation
        self._later: set[asyncio.Task[None]] = set()  # delayed cancels of detached requests
        self._s = settings
        self._models = tuple(models)
        self._backends = backends
        self._policy = policy or RoutingPolicy(())

    async def _watched(self, pool: str, attempt: GenerationRequest) -> AsyncIterator[JobEvent]:
        """The attempt's events; every probe interval without one, check that its worker is still alive
        (or, before any worker took it, that its pool can still serve it better than the fallback).
        Otherwise raise WorkerLost, after which the caller may send the request elsewhere if no
        token was sent yet."""
        backends = self._backends
        events = self._queue.events(attempt.request_id)
        nxt: asyncio.Future[tuple[str, JobEvent]] = asyncio.ensure_future(anext(events))
        worker = ""
        generation = self._queue_generation()
        try:
            while True:
                timeout = backends.check_interval_s if backends is not None else 1.0
                done, _ = await asyncio.wait({nxt}, timeout=timeout)
                if self._queue_generation() != generation:  # its events and job may be gone: never wait on
                    raise errors.QueueUnavailable("Redis came back without its data: this request was lost")
                if not done:
                    if backends is not None and worker and not backends.worker_alive(pool, worker):
                        raise errors.WorkerLost(f"worker {worker!r} of pool {pool!r} stopped answering", running=True)
                    if backends is not None and not worker and backends.stranded(pool):
                        raise errors.WorkerLost(f"pool {pool!r} cannot serve; its fallback can")
                    if not worker:
                        self._check_pool(pool)
                    continue
                try:
                    _eid, ev = nxt.result()
                except StopAsyncIteration:
                    raise errors.WorkerLost("the event stream ended without a terminal event") from None
                worker = ev.worker or worker
                yield ev
                if ev.terminal:
                    return
                nxt = asyncio.ensure_future(anext(events))
        finally:
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
            await events.aclose()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one generation. A client disconnect (CancelledError) cancels the job
        downstream under ``shield`` and re-raises; failures end the RPC with a status.

        Failover: when the worker is lost or its engine dies, the request goes on elsewhere (its
        pool or the fallback, as routed then), at most ``failover_attempts`` times. Before any token
        it simply starts again; after tokens it resumes from what the caller already has (prompt
        plus the tokens sent, with the rest of the budget), so the caller sees one unbroken stream.
        """
        t0 = time.perf_counter()
        req: GenerationRequest | None = None
        outcome = "ok"
        finish = ""
        ttft_ms: float | None = None
        first_token_ns = 0
        submitted = finished = False
        pool = target = ""
        rule: str | None = None
        attempt: GenerationRequest | None = None
        failure: BaseException | None = None
        sent: list[int] = []  # token ids the caller has
        attempts = 0
        deaths = 0  # workers (or engines) that died while running it
        try:
            req, model = convert.generate_request(request, self._s, self._models)
            remaining = context.time_remaining()
            if remaining is not None:  # the caller's deadline is the job's: workers drop or abort it then
                req = replace(req, deadline_unix_ns=time.time_ns() + int(remaining * 1e9))
            structlog.contextvars.bind_contextvars(request_id=req.request_id)
            await context.send_initial_metadata((("x-request-id", req.request_id),))
            target, chosen = self._policy.choose(req, model.pool)
            rule = chosen.text if chosen is not None else None
            while True:
                pool = self._backends.route(target) if self._backends else target
                attempt = req if attempts == 0 else resumed(req, attempts, sent)
                base = len(sent)
                if attempt.sampling.max_tokens is not None and attempt.sampling.max_tokens <= 0:
                    # Every token was sent before the worker was lost, only the end was missing.
                    yield convert.generate_response(req, _length_reached(base))
                    finish, finished = FinishReason.LENGTH.value, True
                    return
                self._check_pool(pool)  # no worker came for a while: say so now, not at the deadline
                self._check_reachable(pool, context.time_remaining())
                record = Attempt(attempt.request_id, base, pool, req.model, req.accepted_unix_ns, request.resumable)
                if not await self._queue.begin(req.request_id, record, first=attempts == 0):
                    # This request id was accepted before (a retry after a lost reply): one job,
                    # so follow the one there is.
                    log.info("request_retried", request_id=req.request_id)
                    async for msg in self._attached(req.request_id, 0):
                        sent.extend(msg.token_ids)
                        yield msg
                    finished = True
                    return
                try:
                    await self._queue.submit(pool, attempt, max_waiting=self._s.max_queue)
                except errors.QueueFull as exc:
                    if attempts == 0:
                        await self._queue.forget(req.request_id)
                    raise errors.QueueFull(exc.message, retry_after_s=self._s.retry_after_s) from None
                submitted, finished = True, False
                try:
                    async for ev in self._watched(pool, attempt):
                        finished = ev.terminal
                        _raise_failure(ev)
                        if ev.token_ids and ttft_ms is None:
                            ttft_ms = round((time.perf_counter() - t0) * 1000, 2)
                            first_token_ns = time.time_ns()
                        if base:
                            ev = _shifted(ev, base, first_token_ns)
                        if ev.token_ids and ev.index != len(sent):  # Redis came back without some events
                            raise errors.QueueUnavailable(
                                f"the queue lost tokens {len(sent)}..{ev.index - 1} of this stream; retry the request"
                            )
                        sent.extend(ev.token_ids)
                        if ev.finished is not None:
                            finish = ev.finished.finish_reason.value
                            if self._backends is not None and ev.finished.started_unix_ns and not attempts:
                                wait_ns = ev.finished.started_unix_ns - attempt.accepted_unix_ns
                                self._backends.observe_queue_wait(pool, max(0, wait_ns) / 1e9)
                        yield convert.generate_response(req, ev)
                        if finished:
                            return
                except (errors.WorkerLost, errors.EngineDead) as exc:
                    deaths += isinstance(exc, errors.EngineDead) or exc.running
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
                        raise
                    await self._backends.record(pool, exc)
                    await asyncio.shield(self._cancel(attempt.request_id))
                    # A worker that comes back skips the lost attempt (it is cancelled).
                    log.warning("request_failed_over", pool=pool, error=str(exc), attempt=attempts + 1,
                                resumed_tokens=len(sent))  # fmt: skip
                    attempts += 1
                    submitted = False
        except errors.LlamameshError as exc:
            failure = exc
            outcome = status.code_for(exc).name
            await status.abort(context, exc)
        except asyncio.CancelledError as exc:
            failure = exc
            outcome = "CANCELLED"
            raise
        finally:
            if submitted and not finished and attempt is not None and req is not None:
                if request.resumable and isinstance(failure, asyncio.CancelledError):
                    # The caller's connection dropped: it may Attach again within the grace.
                    await asyncio.shield(self._detached(req.request_id, attempt.request_id))
                else:  # disconnect, deadline or a failed read: the worker must stop generating
                    await asyncio.shield(self._cancel(attempt.request_id))
            if self._backends is not None and pool and (submitted or failure is not None):
                await asyncio.shield(self._backends.record(pool, failure))
            log.info(
                "rpc_finished",
                method="Generate",
                status=outcome,
                pool=pool or None,
                route=rule,
                failovers=attempts or None,
                finish_reason=finish or None,
                completion_tokens=len(sent),
                ttft_ms=ttft_ms,
                duration_ms=round((time.perf_counter() - t0) * 1000, 2),
            )
            structlog.contextvars.unbind_contextvars("request_id")

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

    def _check_reachable(self, pool: str, remaining_s: float | None) -> None:
        """Refuse at once a request that would wait in the queue past its deadline."""
        wait = self._backends.expected_queue_wait(pool) if self._backends is not None else 0.0
        if remaining_s is not None and wait > 0 and remaining_s < wait:
            raise errors.DeadlineUnreachable(
                f"the deadline ({remaining_s:.3f} s) is shorter than pool {pool!r}'s queue wait ({wait:.3f} s)"
            )

    async def _set_aside(self, pool: str, req: GenerationRequest, deliveries: int, exc: BaseException) -> None:
        try:
            await self._queue.set_aside(pool, req, f"{deliveries} workers were lost running it: {exc}", deliveries)
        except errors.QueueUnavailable:
            log.warning("set_aside_failed", request_id=req.request_id)

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

    async def _attached(
        self, caller_id: str, offset: int, records: list[Attempt] | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The caller's request from token ``offset`` on, through its attempts in order: what each
        abandoned attempt had sent (up to the next one's start), then the last one followed to its
        end. Raises NotFound for an unknown (or expired) id."""
        if records is None:
            records = await self._queue.attempts(caller_id)
        if not records:
            raise errors.NotFound(f"no request {caller_id!r} (unknown, or its events expired)")
        for i, rec in enumerate(records):
            head = GenerationRequest(request_id=caller_id, model=rec.model, accepted_unix_ns=rec.accepted_unix_ns)
            if i + 1 < len(records):  # abandoned at the next one's start: read what it had, no terminal
                end = records[i + 1].base
                for _id, ev in await self._queue.read_events(rec.attempt_id):
                    part = _window(replace(ev, finished=None, failed=None), rec.base, offset, end)
                    if part is not None:
                        yield convert.generate_response(head, part)
                continue
            job = GenerationRequest(request_id=rec.attempt_id, model=rec.model)
            async for ev in self._watched(rec.pool, job):
                _raise_failure(ev)
                part = _window(ev, rec.base, offset, None)
                if part is not None:
                    yield convert.generate_response(head, part)

    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Re-attach to a request by id from token ``offset``, through any gateway (see the proto)."""
        rid = request.request_id
        records: list[Attempt] = []
        try:
            if not convert.REQUEST_ID.match(rid):
                raise errors.InvalidRequest.field("request_id", "required: 1-128 characters of A-Z a-z 0-9 . _ : -")
            records = await self._queue.attempts(rid)
            await self._queue.attach(rid)
            log.info("request_attached", request_id=rid, offset=request.offset)
            async for msg in self._attached(rid, request.offset, records):
                yield msg
        except errors.LlamameshError as exc:
            await status.abort(context, exc)
        except asyncio.CancelledError:
            if records and records[-1].resumable:  # dropped again: the same grace as the first time
                await asyncio.shield(self._detached(rid, records[-1].attempt_id))
            raise

    async def _cancel(self, request_id: str) -> None:
        try:
            await self._queue.cancel(request_id)
        except errors.QueueUnavailable:
            log.warning("cancel_failed", request_id=request_id)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        """Stop a request by id, from any gateway: queued, it never runs; running, it is aborted (its
        slot freed) and its stream ends with finish_reason CANCELLED. Unknown or finished ids are
        not an error (the call is idempotent)."""
        try:
            rid = request.request_id
            if not convert.REQUEST_ID.match(rid):
                raise errors.InvalidRequest.field("request_id", "required: 1-128 characters of A-Z a-z 0-9 . _ : -")
            await self._queue.call_off(rid)
            records = await self._queue.attempts(rid)
            if records and not await self._queue.read_events(records[-1].attempt_id):
                # Still queued: its stream ends now (the worker that reaches the job skips it).
                now = time.time_ns()
                await self._queue.end(records[-1].attempt_id, JobEvent(
                    finished=Finished(FinishReason.CANCELLED, Usage(0, records[-1].base), now)))  # fmt: skip
            log.info("request_cancel_requested", request_id=rid)
            return pb.CancelResponse()
        except errors.LlamameshError as exc:
            await status.abort(context, exc)
            raise  # unreachable: abort raises

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return convert.model_list(self._models)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """Tokenize on a worker of the model's pool (the engine owns the tokenizer)."""
        try:
            req, model = convert.tokenize_request(request, self._models)
            await self._queue.submit(model.pool, req)
            async for _eid, ev in self._queue.events(req.request_id):
                _raise_failure(ev)
                if ev.terminal:
                    return convert.tokenize_response(req, ev)
            raise errors.WorkerLost("the worker ended without an answer")
        except errors.LlamameshError as exc:
            await status.abort(context, exc)
            raise  # unreachable: abort raises
