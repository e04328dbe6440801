"""The gatekeeper: one server interceptor in front of every RPC but ``grpc.health.v1``, which checks
each call's size, this process's concurrency and the caller's identity before its handler runs.
Handlers read the caller's identity with ``identity(context)``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from llamamesh import errors, metrics
from llamamesh.settings import LimitsSettings
from llamamesh.tenants import Identity, TenantsFile
from llamamesh.types import DEFAULT_TENANT, TENANT_NAME
from services import status

log = structlog.get_logger(__name__)

TENANT_HEADER = "x-llamamesh-tenant"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_PREFIX = "/llamamesh.v1.AdminService/"

_identity: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("identity", default=None)


class _Unparsed:
    """A request's bytes as received, parsed only once its caller is admitted (``_parser``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


Header = Callable[[str], str]
"""A call's header (gRPC metadata, HTTP header) by its lower-case name; "" when absent."""


def _metadata(context: grpc.aio.ServicerContext) -> Header:
    def get(key: str) -> str:
        for k, v in context.invocation_metadata() or ():
            if k == key:
                return v if isinstance(v, str) else v.decode(errors="replace")
        return ""

    return get


def identity_from_header(header: Header, defaults: LimitsSettings) -> Identity:
    """Without authentication: the tenant the caller names (``x-llamamesh-tenant``), else "default"."""
    named = header(TENANT_HEADER)
    if not named:
        return Identity(DEFAULT_TENANT, "none", defaults, admin=True)
    if not TENANT_NAME.match(named):
        raise errors.InvalidRequest.field(TENANT_HEADER, "1-64 characters of A-Z a-z 0-9 . _ -")
    return Identity(named, "header", defaults, admin=True)


def header_identity(context: grpc.aio.ServicerContext, defaults: LimitsSettings) -> Identity:
    return identity_from_header(_metadata(context), defaults)


def identity(context: grpc.aio.ServicerContext, defaults: LimitsSettings | None = None) -> Identity:
    """The identity the gatekeeper found for this call (a server without one: the header's)."""
    found = _identity.get()
    return found if found is not None else header_identity(context, defaults or LimitsSettings())


def bearer(header: Header) -> str:
    """The API key of an ``authorization: Bearer <key>`` header ("" without one)."""
    raw = header("authorization").strip()
    scheme, _, key = raw.partition(" ")
    if raw and scheme.lower() != "bearer":
        raise errors.Unauthenticated("the authorization header must be 'Bearer <API key>'")
    if not key.isascii():  # no key is (the HTTP door passes other bytes through undecoded)
        raise errors.Unauthenticated("invalid API key")
    return key.strip()


def _certificates(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    from services.tls import peer_identities  # the TLS seam: grpc's auth context

    return peer_identities(context)


class Gatekeeper(grpc.aio.ServerInterceptor):
    """For each call, before its handler runs:

    1. **Concurrency**: at most ``LLAMAMESH_GATEWAY_MAX_CONCURRENT_RPCS`` calls at once in this
       process (RESOURCE_EXHAUSTED with RetryInfo past it).
    2. **Identity**: with a tenants file (``LLAMAMESH_AUTH_FILE``), an API key
       (``authorization: Bearer <key>``) or a client certificate that the file maps to a tenant;
       otherwise UNAUTHENTICATED. AdminService needs an admin identity (PERMISSION_DENIED). Each
       decision is one ``auth_decided`` log line (tenant, key id, method, outcome), never the key.
       Without a tenants file the tenant is the ``x-llamamesh-tenant`` header (else "default"), as
       for the embedded node on loopback.
    3. **Size**: the request's bytes are checked against its method's limit
       (``LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES``; BatchGenerate: ``LLAMAMESH_BATCH_MAX_BYTES``), then
       parsed; bytes over it or that do not parse are refused: INVALID_ARGUMENT, nothing queued.
       A caller that is not admitted has nothing of its request parsed.
    """

    def __init__(
        self,
        tenants: TenantsFile | None,
        defaults: LimitsSettings,
        max_concurrent: int,
        max_bytes: int,
        max_bytes_by_method: dict[str, tuple[int, str]],
    ) -> None:
        self._tenants = tenants
        self._defaults = defaults
        self._max_concurrent = max_concurrent
        self._max_bytes = max_bytes
        self._by_method = max_bytes_by_method
        self.active = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        limit, setting = self._by_method.get(method, (self._max_bytes, "LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES"))
        parse = _parser(handler.request_deserializer, limit, setting)
        changes: dict[str, Any] = {"request_deserializer": _Unparsed}  # (parsed by the guard, once admitted)
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                changes[kind] = self._guarded(
                    behavior, method, parse, (kind.endswith("_stream"), kind.startswith("stream"))
                )
        return handler._replace(**changes)  # type: ignore[attr-defined, no-any-return]  # a namedtuple

    def decide(self, method: str, header: Header, certificates: tuple[str, ...] = ()) -> Identity:
        """The caller's identity, or a domain error (logged as the decision)."""
        if self._tenants is None:
            return identity_from_header(header, self._defaults)
        who: Identity | None = None
        try:
            who = self._tenants.current().authenticate(bearer(header), certificates)
            if method.startswith(ADMIN_PREFIX) and not who.admin:
                raise errors.PermissionDenied("AdminService needs an admin key or an admin tenant")
        except errors.LlamameshError as exc:
            metrics.rejected(exc)
            outcome = status.code_for(exc).name.lower()
            log.info(
                "auth_decided",
                method=method,
                outcome=outcome,
                tenant=who.tenant if who else None,
                key_id=who.key_id if who else None,
                reason=exc.message,
            )
            raise
        log.info("auth_decided", method=method, outcome="allowed", tenant=who.tenant, key_id=who.key_id, via=who.via)
        return who

    def check_concurrency(self) -> None:
        """RateLimited when this process serves its most calls (both doors count)."""
        if self.active >= self._max_concurrent:
            metrics.rejected(reason="max_concurrent_rpcs")
            raise errors.RateLimited(
                f"this gateway process is serving {self.active} calls, its most "
                "(LLAMAMESH_GATEWAY_MAX_CONCURRENT_RPCS); retry shortly or through another gateway",
                retry_after_s=0.5,
            )

    @staticmethod
    def _letting_go(call: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Any:
        """``call``, whose refusal (a domain error answered as its status: grpc's AbortError) lets go
        of its request (up to LLAMAMESH_BATCH_MAX_BYTES) when it ends. grpc keeps the error with the
        call's state, and the error's traceback (and the error it was raised from) holds every frame
        it went through, each holding the request; those end up in reference cycles that only the
        garbage collector's rare full pass frees, so a gateway refusing large requests grew by each.
        The error goes on without them: its status and message are the call's answer, and the call
        was logged with them. Frames are not cleared by hand: a traceback may hold another task's
        suspended frames, which clearing would close."""

        @functools.wraps(call)
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await call(request, context)
            except grpc.aio.AbortError as exc:  # a domain error, answered (and logged) as the call's status
                request = None
                exc.__traceback__ = exc.__context__ = exc.__cause__ = None
                raise

        return guarded

    def _admitted(self, context: grpc.aio.ServicerContext, method: str) -> Identity:
        self.check_concurrency()
        certificates = _certificates(context) if self._tenants is not None else ()
        return self.decide(method, _metadata(context), certificates)

    def _guarded(self, behavior: Any, method: str, parse: Callable[[Any], Any], kind: tuple[bool, bool]) -> Any:
        """``behavior`` run only for an admitted caller, its identity bound for the handler, and given
        its request parsed only then (``kind``: whether the responses and the requests stream)."""
        gate = self
        streaming, request_streaming = kind

        async def enter(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                who = gate._admitted(context, method)
                request = request if request_streaming else parse(request)
            except errors.LlamameshError as exc:
                if isinstance(request, _Unparsed):
                    request.data = b""  # (a refused caller's bytes go now, whatever holds this)
                await status.abort(context, exc)  # raises
            # Each call runs in its own task (its own context): the identity ends with it.
            _identity.set(who)
            return request

        if streaming:

            @gate._letting_go
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                request = await enter(request, context)
                gate.active += 1
                try:
                    result = behavior(_screened(request, context, parse) if request_streaming else request, context)
                    if inspect.isasyncgen(result):
                        # Written here and closed here, in the call's task, on every way out. Given to
                        # grpc, a generator it stops iterating (its write failed: the caller went
                        # away) is closed later by the garbage collector's hook, in another task and
                        # context: its clean-up then ran late, and failed resetting context variables.
                        try:
                            async for msg in result:
                                await context.write(msg)
                        finally:
                            await result.aclose()
                    else:  # a handler that writes with context.write
                        await result
                finally:
                    gate.active -= 1

            return stream

        @gate._letting_go
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await enter(request, context)
            gate.active += 1
            try:
                return await behavior(_screened(request, context, parse) if request_streaming else request, context)
            finally:
                gate.active -= 1

        return unary


async def _screened(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, parse: Callable[[Any], Any]
) -> AsyncIterator[Any]:
    """A client stream's requests, each parsed (INVALID_ARGUMENT ends the call at one that cannot be)."""
    async for r in requests:
        try:
            parsed = parse(r)
        except errors.LlamameshError as exc:
            await status.abort(context, exc)  # raises
        yield parsed


def _parser(deserialize: Callable[[bytes], Any] | None, limit: int, setting: str) -> Callable[[_Unparsed], Any]:
    """The request of an admitted caller from its bytes, or InvalidRequest (raised) for more than
    ``limit`` bytes (refused unparsed) or bytes that do not parse."""

    def parse(raw: _Unparsed) -> Any:
        data, raw.data = raw.data, b""  # (taken: the bytes go once parsed)
        if len(data) > limit:
            why = f"the request is {len(data)} bytes; at most {limit} ({setting})"
        elif deserialize is None:
            return data
        else:
            try:
                return deserialize(data)
            except Exception:  # protobuf's DecodeError and friends: the bytes are not this message
                why = "the request message does not parse"
        del data  # (not held by the error's frames)
        raise errors.InvalidRequest.field("request", why)

    return parse
