"""GenerationService: validate, enqueue, relay the worker's events to the caller."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog

from llamamesh import errors
from llamamesh.queue.protocol import JobQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import GenerationRequest, JobEvent, ModelInfo
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services import convert, status

log = structlog.get_logger(__name__)


def _raise_failure(ev: JobEvent) -> None:
    if ev.failed is not None:
        f = ev.failed
        raise errors.from_code(f.code, f.message, f.field)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, queue: JobQueue, settings: GatewaySettings, models: Sequence[ModelInfo]) -> None:
        self._queue = queue
        self._s = settings
        self._models = tuple(models)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one generation. A client disconnect (CancelledError) cancels the job
        downstream under ``shield`` and re-raises; failures end the RPC with a status."""
        t0 = time.perf_counter()
        req: GenerationRequest | None = None
        outcome = "ok"
        finish = ""
        tokens = 0
        ttft_ms: float | None = None
        submitted = finished = False
        try:
            req, model = convert.generate_request(request, self._s, self._models)
            structlog.contextvars.bind_contextvars(request_id=req.request_id)
            await context.send_initial_metadata((("x-request-id", req.request_id),))
            await self._queue.submit(model.pool, req)
            submitted = True
            async for _eid, ev in self._queue.events(req.request_id):
                finished = ev.terminal
                _raise_failure(ev)
                if ev.token_ids and ttft_ms is None:
                    ttft_ms = round((time.perf_counter() - t0) * 1000, 2)
                tokens += len(ev.token_ids)
                if ev.finished is not None:
                    finish = ev.finished.finish_reason.value
                yield convert.generate_response(req, ev)
                if finished:
                    return
        except errors.LlamameshError as exc:
            outcome = status.code_for(exc).name
            await status.abort(context, exc)
        except asyncio.CancelledError:
            outcome = "CANCELLED"
            raise
        finally:
            if submitted and not finished and req is not None:
                # Disconnect, deadline or a failed read: the worker must stop generating.
                await asyncio.shield(self._cancel(req.request_id))
            log.info(
                "rpc_finished",
                method="Generate",
                status=outcome,
                finish_reason=finish or None,
                completion_tokens=tokens,
                ttft_ms=ttft_ms,
                duration_ms=round((time.perf_counter() - t0) * 1000, 2),
            )
            structlog.contextvars.unbind_contextvars("request_id")

    async def _cancel(self, request_id: str) -> None:
        try:
            await self._queue.cancel(request_id)
        except errors.QueueUnavailable:
            log.warning("cancel_failed", request_id=request_id)

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
