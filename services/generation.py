"""GenerationService: each handler converts, calls the relay (services/relay.py), and lets
``calls.rpc`` map domain errors to statuses and write the ``rpc_finished`` line."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import replace

import grpc
import structlog

from llamamesh import errors
from llamamesh.settings import GatewaySettings
from llamamesh.types import ModelInfo
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services import convert
from services.calls import note, rpc
from services.relay import Progress, Relay

log = structlog.get_logger(__name__)


def _checked_id(request_id: str) -> str:
    if not convert.REQUEST_ID.match(request_id):
        raise errors.InvalidRequest.field("request_id", "required: 1-128 characters of A-Z a-z 0-9 . _ : -")
    return request_id


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, relay: Relay, settings: GatewaySettings, models: Sequence[ModelInfo]) -> None:
        self._relay = relay
        self._s = settings
        self._models = tuple(models)

    @rpc("Generate")
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one generation (failover, resume and liveness: the relay's)."""
        req, model = convert.generate_request(request, self._s, self._models)
        remaining = context.time_remaining()
        if remaining is not None:  # the caller's deadline is the job's: workers drop or abort it then
            req = replace(req, deadline_unix_ns=time.time_ns() + int(remaining * 1e9))
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        await context.send_initial_metadata((("x-request-id", req.request_id),))
        progress = Progress()
        try:
            async with aclosing(self._relay.generate(req, model.pool, progress, request.resumable)) as events:
                async for ev in events:
                    yield convert.generate_response(req, ev)
        finally:
            note(pool=progress.pool or None, route=progress.route, failovers=progress.failovers or None,
                 finish_reason=progress.finish or None, completion_tokens=progress.tokens,
                 ttft_ms=progress.ttft_ms)  # fmt: skip

    @rpc("Attach")
    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Re-attach to a request by id from token ``offset``, through any gateway (see the proto)."""
        rid = _checked_id(request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        async with aclosing(self._relay.attach(rid, request.offset)) as events:
            async for head, ev in events:
                yield convert.generate_response(head, ev)

    @rpc("Cancel")
    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        """Stop a request by id, from any gateway: queued, it never runs; running, it is aborted (its
        slot freed) and its stream ends with finish_reason CANCELLED. Unknown or finished ids are
        not an error (the call is idempotent)."""
        await self._relay.cancel(_checked_id(request.request_id))
        return pb.CancelResponse()

    @rpc("ListModels")
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return convert.model_list(self._models)

    @rpc("Tokenize")
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """Tokenize on a worker of the model's pool (the engine owns the tokenizer)."""
        req, model = convert.tokenize_request(request, self._models)
        return convert.tokenize_response(req, await self._relay.tokenize(req, model.pool))
