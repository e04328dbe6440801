"""The OpenAI-compatible HTTP door (``LLAMAMESH_GATEWAY_HTTP_PORT``): aiohttp on the gateway's own
event loop, in front of the same servicer, relay, admission, gatekeeper and call bookkeeping as the
gRPC door. It converts OpenAI's JSON to the gateway's request (services/http/openai_requests.py)
and the responses back (services/http/openai_responses.py); nothing else is its own.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: whole, or streamed as server-sent events
  (``stream: true``) ending with ``data: [DONE]``; ``x-request-id`` in and out; a caller that goes
  away cancels its request, as on gRPC.
- ``GET /v1/models``, ``GET /v1/models/{id}``.
- Files and Batches in OpenAI's format (services/http/batches.py), when the gateway runs the batch
  service.
- Errors: OpenAI's ``{"error": {message, type, param, code}}`` with the matching HTTP status (400
  naming the field, 401, 403, 404, 409, 429 with ``Retry-After``, 503, 504).
"""

from __future__ import annotations

import logging
import ssl
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from llamamesh import errors
from llamamesh.ports import check_free
from llamamesh.settings import GatewaySettings
from llamamesh.tenants import Identity
from llamamesh.types import ModelInfo
from llamamesh.v1 import generation_pb2 as pb
from services import admission, convert
from services.auth import Gatekeeper
from services.calls import answered_with, call, note
from services.generation import GenerationServicer
from services.http import openai_requests, openai_responses
from services.http.batches import BatchRoutes
from services.http.fanout import merged
from services.http.openai_requests import Parsed
from services.http.wire import Handler, Runner, Work, event, read_json
from services.tls import peer_names

log = structlog.get_logger(__name__)

# A connection that sends no request for this long is closed: before its first request (a request
# head still arriving counts as none) and between requests on a kept-alive one (seconds).
IDLE_S = 15.0
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _without_request_bytes(record: logging.LogRecord) -> bool:
    """A line of aiohttp's with a parser's error (a request head wire.Runner's handler did not see
    first, or a body's), which quotes the bytes it stopped at (an authorization header's API key
    among them): the line keeps only the kind. A caller gone mid-answer is no server error: one info
    line, no traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, HttpProcessingError):
        record.msg, record.args = "http_request_refused %s (status %s)", (type(exc).__name__, exc.code)
    elif isinstance(exc, ConnectionResetError):  # the caller went away mid-answer: its call ends CANCELLED
        record.msg, record.args = "http_caller_gone %s", (type(exc).__name__,)
    else:
        return True
    record.exc_info, record.exc_text = None, None
    record.levelno, record.levelname = logging.INFO, "INFO"
    return True


# The door's protocol log (aiohttp's server logger, for this door's connections).
PROTOCOL_LOG = logging.getLogger("llamamesh.http.protocol")
PROTOCOL_LOG.addFilter(_without_request_bytes)


class HttpDoor:
    def __init__(
        self,
        generation: GenerationServicer,
        gatekeeper: Gatekeeper,
        settings: GatewaySettings,
        models: Sequence[ModelInfo],
        adapters_of: Callable[[str], frozenset[str] | None],
        batches: BatchRoutes | None = None,
    ) -> None:
        """``batches``: the Files and Batches endpoints (None: the gateway runs no batch service)."""
        self._generation = generation
        self.batches = batches
        # The largest body: a chat request, or an uploaded batch file with its multipart framing.
        self._client_max_size = max(settings.max_request_bytes, batches.max_bytes + 65536 if batches else 0)
        self._gate = gatekeeper
        self._s = settings
        self._models = tuple(models)
        self._adapters_of = adapters_of
        self._runner: Runner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._client_max_size, middlewares=[_errors])
        app.router.add_post(
            "/v1/chat/completions", self.route("ChatCompletions", self._completions(openai_requests.chat))
        )
        app.router.add_post("/v1/completions", self.route("Completions", self._completions(openai_requests.completion)))
        app.router.add_get("/v1/models", self.route("ListModels", self._list_models))
        app.router.add_get("/v1/models/{id:.+}", self.route("GetModel", self._get_model))
        if self.batches is not None:
            self.batches.add_routes(app, self.route)
        return app

    def route(self, method: str, work: Work) -> Handler:
        """A handler: the call's bookkeeping (services/calls.py: its log line, metrics, span), the
        gatekeeper's identity and concurrency, ``work``, and any domain error in OpenAI's shape."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                # Admitted first, as the gRPC gatekeeper does: a refused caller's call is not one of
                # llamamesh_requests_total (llamamesh_admission_rejected_total counts it).
                who = self._who(request, method)
                async with call(method, request.headers.items(), "http"):
                    self._gate.active += 1
                    try:
                        answer = await work(request, who)
                    finally:
                        self._gate.active -= 1
                if not answer.prepared and "x-request-id" not in answer.headers:  # every answer carries one
                    answer.headers.update(_request_id(request))
                return answer
            except (web.HTTPException, ConnectionResetError):
                raise  # (a path or method this door lacks: _errors; a caller gone mid-body: no one to answer)
            except Exception as exc:  # recorded by call(); answered in OpenAI's shape (anything else: 500, logged)
                http, body, headers = openai_responses.error(exc)
                return web.json_response(body, status=http, headers={**headers, **_request_id(request)})

        return handle

    async def start(self, port: int, ssl_context: ssl.SSLContext | None, share_port: bool) -> int:
        """Listen on ``settings.host``:``port`` (0: a free one); returns the port."""
        # handler_cancellation: a caller that disconnects cancels its handler, and so its request.
        self._runner = Runner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self._s.grace_s,
            keepalive_timeout=IDLE_S,
            logger=PROTOCOL_LOG,
        )
        check_free(self._s.host, port, "LLAMAMESH_GATEWAY_HTTP_PORT", reuse_port=share_port)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._s.host, port, ssl_context=ssl_context, reuse_port=share_port or None)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        """Stop accepting, give open requests the gateway's grace_s, then close."""
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()

    def _who(self, request: web.Request, method: str) -> Identity:
        self._gate.check_concurrency()
        peer = request.transport.get_extra_info("peercert") if request.transport is not None else None
        return self._gate.decide(method, lambda key: request.headers.get(key, ""), peer_names(peer))

    def _completions(self, parse: openai_requests.Parse) -> Work:
        async def work(request: web.Request, who: Identity) -> web.StreamResponse:
            body = await read_json(request, self._s.max_request_bytes)
            given = request.headers.get("x-request-id", "")
            if given and not convert.REQUEST_ID.match(given):  # (it may not even be text to put in a message)
                raise errors.InvalidRequest.field("x-request-id", convert.ID_RULE)
            parsed = parse(body, given)
            if given and (n := len(parsed.prompts)) > 1:  # each prompt's id is <x-request-id>:<i>
                most = convert.MAX_REQUEST_ID - len(f":{n - 1}")
                if len(given) > most:
                    raise errors.InvalidRequest.field("x-request-id", f"at most {most} characters with {n} prompts")
            try:
                return await self._answer(request, parsed, who)
            except errors.InvalidRequest as exc:  # the fields as the caller named them (same class: its code)
                raise type(exc)(
                    [errors.FieldViolation(parsed.caller_field(v.field), v.description) for v in exc.violations]
                ) from None

        return work

    async def _answer(self, request: web.Request, parsed: Parsed, who: Identity) -> web.StreamResponse:
        # Several prompts: one request each, ids <id>:<i> under one id (the caller's, or made here).
        several = len(parsed.prompts) > 1
        admission.check_streams(who, len(parsed.prompts), "prompt", f"{len(parsed.prompts)} prompts")
        base_id = parsed.request.request_id or (uuid.uuid4().hex if several else "")
        if several:
            structlog.contextvars.bind_contextvars(request_id=base_id)
        out = openai_responses.Completion(
            base_id, parsed.chat, parsed.logprobs, per_prompt=parsed.request.n or 1, include_usage=parsed.include_usage
        )
        sse = _Events(request, out, len(parsed.prompts))

        async def accepted(public: str) -> None:
            if not several:
                out.request_id = public

        streams = [self._generation.stream(r, who, None, accepted) for r in parsed.requests(base_id)]
        if several:
            streams = [_of_prompt(i, s) for i, s in enumerate(streams)]
        try:
            async with aclosing(merged(streams)) as responses:
                async for i, r in responses:
                    if r.finish_reason == pb.FINISH_REASON_CANCELLED:  # (OpenAI's answers have no such end)
                        raise errors.FailedPrecondition(
                            f"request {out.request_id or base_id!r} was cancelled (a Cancel, or its caller went "
                            "away before it ended): send it again under a new x-request-id"
                        )
                    if parsed.stream:
                        await sse.send(i, out.chunks(r, i))
                    else:
                        out.add(r, i)
        except errors.LlamameshError as exc:
            if sse.started is None:
                raise
            _, body, _ = openai_responses.error(exc, parsed.caller_field)
            answered_with(exc)
            await event(sse.started, body)  # mid-stream: the error as the last event, as vLLM does
            await sse.started.write_eof()
            return sse.started
        if several and out.usage is not None:  # the call's line: every prompt's tokens, not the last one's
            note(prompts=len(parsed.prompts), completion_tokens=out.usage["completion_tokens"])
        if not parsed.stream:
            return web.json_response(out.body(), headers={"x-request-id": out.request_id})
        stream_out = await sse.flush()
        if parsed.include_usage:
            await event(stream_out, out.usage_chunk())
        await stream_out.write(b"data: [DONE]\n\n")
        await stream_out.write_eof()
        return stream_out

    async def _list_models(self, request: web.Request, who: Identity) -> web.StreamResponse:
        models = convert.with_adapters(self._models, self._adapters_of)
        return web.json_response({"object": "list", "data": [_model(m.id) for m in models]})

    async def _get_model(self, request: web.Request, who: Identity) -> web.StreamResponse:
        wanted = request.match_info["id"]
        if not any(m.id == wanted for m in convert.with_adapters(self._models, self._adapters_of)):
            raise errors.ModelNotFound(f"model {convert.shown(wanted)} is not served here")
        return web.json_response(_model(wanted))


class _Events:
    """A streamed answer's server-sent events. Its status and headers go with its first message, and
    (several prompts) once every prompt has sent one: an error before (a prompt longer than the model,
    found by the worker) is the same 4xx as without streaming, whichever prompt's worker found it first."""

    def __init__(self, request: web.Request, out: openai_responses.Completion, prompts: int) -> None:
        self._request = request
        self._out = out
        self._waiting = set(range(prompts)) if prompts > 1 else set()
        self._held: list[dict[str, Any]] = []
        self.started: web.StreamResponse | None = None

    async def send(self, prompt: int, chunks: list[dict[str, Any]]) -> None:
        self._waiting.discard(prompt)
        self._held.extend(chunks)
        if not self._waiting and self._held:
            await self.flush()

    async def flush(self) -> web.StreamResponse:
        """The response, begun, with every chunk held so far sent."""
        if self.started is None:
            self.started = web.StreamResponse(headers={**SSE_HEADERS, "x-request-id": self._out.request_id})
            await self.started.prepare(self._request)
        for chunk in self._held:
            await event(self.started, chunk)
        self._held.clear()
        return self.started


async def _of_prompt(
    i: int, responses: AsyncGenerator[pb.GenerateResponse, None]
) -> AsyncGenerator[pb.GenerateResponse, None]:
    """``responses`` to prompt ``i`` of several: a bad prompt is named ``prompt[i]``."""
    try:
        async with aclosing(responses) as stream:
            async for r in stream:
                yield r
    except errors.InvalidRequest as exc:
        named = [
            errors.FieldViolation(f"prompt[{i}]" if v.field == "prompt" else v.field, v.description)
            for v in exc.violations
        ]
        raise type(exc)(named) from None


def _model(model_id: str) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "llamamesh"}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A path or method this door lacks, in OpenAI's error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        body = {"error": {"message": exc.reason, "type": kind, "param": None, "code": None}}
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}  # a 405's methods
        return web.json_response(body, status=exc.status, headers={**allow, **_request_id(request)})


def _request_id(request: web.Request) -> dict[str, str]:
    """An answer's ``x-request-id`` header: the caller's id, or one made for it (also in place of one
    that is not an id, which may not even be text to echo)."""
    given = request.headers.get("x-request-id", "")
    return {"x-request-id": given if convert.REQUEST_ID.match(given) else uuid.uuid4().hex}
