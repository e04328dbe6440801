"""GenerationService: each handler converts, calls the relay (services/relay.py), and lets
``calls.rpc`` map domain errors to statuses and write the ``rpc_finished`` line."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace

import grpc
import structlog

from llamamesh import errors, tracing
from llamamesh.settings import GatewaySettings
from llamamesh.tenants import Identity
from llamamesh.types import DEFAULT_TENANT, GenerationRequest, ModelInfo, scoped_id
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services import convert, tools
from services.admission import Admission, access_of, cache_scoped, check_priority
from services.auth import identity
from services.calls import delivered, note, rpc
from services.normalize import Normalizer
from services.relay import Relay
from services.relayed import Caller, Progress

log = structlog.get_logger(__name__)

# Seconds past which a caller's deadline is taken as none (a year; gRPC's largest is about 11 400 years).
FAR_DEADLINE_S = 365 * 24 * 3600.0


def _fingerprint(request: pb.GenerateRequest) -> str:
    """What makes two Generates the same request (an idempotent retry), whatever their deadlines."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


def _checked_id(request_id: str) -> str:
    if not convert.REQUEST_ID.match(request_id):
        raise errors.InvalidRequest.field("request_id", f"required: {convert.ID_RULE}")
    return request_id


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Every request id is the caller's tenant's (``scoped_id``): another tenant's ids are unknown
    here (NOT_FOUND, never "exists")."""

    def __init__(
        self,
        relay: Relay,
        settings: GatewaySettings,
        models: Sequence[ModelInfo],
        admission: Admission | None = None,
        normalizer: Normalizer | None = None,
        adapters_of: Callable[[str], frozenset[str] | None] = lambda pool: None,
        tenant_cache: bool = False,
    ) -> None:
        """``adapters_of(pool)``: the LoRA adapters the pool's ready workers serve (None: not known);
        ``tenant_cache``: each tenant's prompts are cached apart (``cache_scoped``)."""
        self._relay = relay
        self._s = settings
        self._models = tuple(models)
        self._admission = admission or Admission(None)
        self._normalizer = normalizer or Normalizer()
        self._adapters_of = adapters_of
        self._tenant_cache = tenant_cache

    @rpc("Generate")
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async def accepted(public: str) -> None:
            await context.send_initial_metadata((("x-request-id", public),))

        streamed = self.stream(request, identity(context), context.time_remaining(), accepted)
        async with aclosing(streamed) as responses:
            async for msg in responses:
                yield msg
                if msg.HasField("usage"):  # the last one
                    delivered()

    async def stream(
        self,
        request: pb.GenerateRequest,
        who: Identity,
        remaining_s: float | None,
        accepted: Callable[[str], Awaitable[None]],
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Stream one generation for ``who``, through either door (gRPC's Generate, the HTTP door's
        completions): failover, resume and liveness are the relay's, within the tenant's budgets
        (services/admission.py). The prompt is normalised (services/normalize.py) before routing
        and queueing; the idempotency fingerprint is of what the caller sent. ``remaining_s``: the
        caller's deadline (None: none); ``accepted(request_id)`` runs once it is admitted."""
        req, model = convert.generate_request(request, self._s, self._models)
        convert.check_adapter(req.adapter, model, self._adapters_of)
        req = self._normalized(req)
        check_priority(who, req.priority)
        public = req.request_id
        deadline = 0  # (none; nor one beyond any run: Java's "none" is about 292 years, past an int64 of ns)
        if remaining_s is not None and remaining_s <= FAR_DEADLINE_S:
            deadline = time.time_ns() + int(remaining_s * 1e9)
        # The caller's deadline is the job's: workers drop or abort it then.
        req = replace(
            req,
            request_id=scoped_id(who.tenant, public),
            deadline_unix_ns=deadline,
            tenant="" if who.tenant == DEFAULT_TENANT else who.tenant,
            trace=tracing.carrier(),
        )  # the RPC's span: the worker's parent
        req = cache_scoped(req, who.tenant) if self._tenant_cache else req
        caller = Caller(_fingerprint(request), access_of(who), who.limits.weight)
        structlog.contextvars.bind_contextvars(request_id=public)
        # The model's pool until the call runs on one (a call refused or cancelled before is counted there).
        note(tenant=who.tenant, pool=model.pool, labels=dict(req.metadata) or None)
        # The most it may generate is held from the tenant's tokens per minute until it ends.
        reserved = (req.sampling.max_tokens or 0) * (req.sampling.n or 1) if who.limits.tokens_per_min else 0
        await self._admission.request(who, reserved)
        progress = Progress()
        try:
            async with self._admission.stream(who):
                await accepted(public)
                relayed = self._relay.generate(req, model.pool, progress, request.resumable, caller)
                calls = tools.CallReader(tools.checked(request, [], self._s.tool_parser))  # (checked above)
                async with aclosing(relayed) as events:
                    async for ev in events:
                        for msg in calls.feed(convert.generate_response(req, ev, request_id=public)):
                            yield msg
        finally:
            # A resumable request its caller left goes on generating (for an Attach): it keeps all
            # it reserved, what it may still generate, rather than what this stream delivered.
            await self._admission.spent(who, reserved if progress.detached else progress.tokens, reserved)
            note(
                pool=progress.pool or model.pool,
                route=progress.route,
                failovers=progress.failovers or None,
                finish_reason=progress.finish or None,
                completion_tokens=progress.tokens,
                ttft_ms=progress.ttft_ms,
            )

    def _normalized(self, req: GenerationRequest) -> GenerationRequest:
        out = self._normalizer.apply(req)
        if out is not req:
            note(normalized=True)
        return out

    @rpc("Attach")
    async def Attach(
        self, request: pb.AttachRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Re-attach to a request by id from token ``offset``, through any gateway (see the proto)."""
        who = identity(context)
        public = _checked_id(request.request_id)
        structlog.contextvars.bind_contextvars(request_id=public)
        note(tenant=who.tenant)
        attached = self._relay.attach(
            scoped_id(who.tenant, public), request.offset, sample_offsets=tuple(request.sample_offsets)
        )
        async with self._admission.stream(who), aclosing(attached) as events:
            async for head, ev in events:
                msg = convert.generate_response(head, ev, request_id=public)
                yield msg
                if msg.HasField("usage"):
                    delivered()

    @rpc("Cancel")
    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        """Stop a request by id, from any gateway: queued, it never runs; running, it is aborted (its
        slot freed) and its stream ends with finish_reason CANCELLED. Unknown or finished ids are
        not an error (the call is idempotent)."""
        who = identity(context)
        await self._relay.cancel(scoped_id(who.tenant, _checked_id(request.request_id)))
        return pb.CancelResponse()

    @rpc("ListModels")
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return convert.model_list(convert.with_adapters(self._models, self._adapters_of))

    @rpc("Tokenize")
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        """Tokenize on a worker of the model's pool (the engine owns the tokenizer), after the
        same normalisation as Generate, so the count is that of the text generation would see."""
        identity(context)  # a bad tenant header is refused here too
        req, model = convert.tokenize_request(request, self._models, self._s.max_prompt_chars)
        req = replace(self._normalized(req), trace=tracing.carrier())
        return convert.tokenize_response(req, await self._relay.tokenize(req, model.pool))
