"""One wrapper for every RPC handler (``rpc``): domain errors become statuses, and each call ends with
one ``rpc_finished`` line (method, status, duration, and what the handler ``note``-d: pool,
tokens...), its metrics and its span.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import grpc
import structlog

from llamamesh import errors, metrics, tracing
from services import status

log = structlog.get_logger(__name__)

_fields: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rpc_fields", default=None)

F = TypeVar("F", bound=Callable[..., Any])


def note(**fields: Any) -> None:
    """Add fields to the current call's ``rpc_finished`` line (None values are left out)."""
    current = _fields.get()
    if current is not None:
        current.update(fields)


_OUTCOME = "_outcome"  # (a field of no log line: the status a door answered with itself)
_DELIVERED = "_delivered"  # (nor this: the stream's last message went out)
# A call cancelled this close to its deadline ran out of time: the caller's own deadline fires first and
# cancels it, the gateway's (counted from when the call arrived) a little later.
DEADLINE_SLACK_S = 1.0


def answered_with(exc: errors.LlamameshError) -> None:
    """The current call ended with ``exc``, sent by its door itself rather than raised (an error
    event after a stream began): the call's status and error, as if raised."""
    current = _fields.get()
    if current is not None:
        current[_OUTCOME] = status.code_for(exc).name
        current["error"] = exc.message


def delivered() -> None:
    """The current call's last message went out: a cancel after it (the caller leaving before the trailers came)
    ends nothing, and the call counts as what it was, a success."""
    current = _fields.get()
    if current is not None:
        current[_DELIVERED] = True


def _finished(method: str, outcome: str, t0: float, fields: dict[str, Any]) -> None:
    seconds = time.perf_counter() - t0
    extra = {k: v for k, v in fields.items() if v is not None}
    log.info("rpc_finished", method=method, status=outcome, duration_ms=round(seconds * 1000, 2), **extra)
    metrics.REQUESTS.labels(method, "OK" if outcome == "ok" else outcome, str(extra.get("pool", ""))).inc()
    metrics.REQUEST_DURATION.labels(method).observe(seconds)


def _other(exc: BaseException) -> str:
    """The status of a call that ended other than by a domain error."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit | ConnectionResetError):
        return "CANCELLED"  # the caller went away (or stopped reading)
    return "ABORTED" if isinstance(exc, grpc.aio.AbortError) else "INTERNAL"


@contextlib.asynccontextmanager
async def call(
    method: str,
    metadata: Iterable[tuple[str, str | bytes]] | None,
    system: str = "grpc",
    expired: Callable[[], bool] = lambda: False,
) -> AsyncIterator[None]:
    """One call's bookkeeping, whichever door it came through: its fields for ``note``, its status,
    its span (continuing the ``traceparent`` in ``metadata``) and its ``rpc_finished`` line. A
    domain error is recorded with its gRPC code name and propagates; a call cancelled once
    ``expired()`` (its deadline passed, or is at most DEADLINE_SLACK_S away) is DEADLINE_EXCEEDED, one
    cancelled after its last message was ``delivered`` ok, else CANCELLED."""
    t0, fields = time.perf_counter(), dict[str, Any]()
    token = _fields.set(fields)
    outcome = "ok"  # a success's status in the log line; failures carry the gRPC code name
    metrics.INFLIGHT.inc()
    with tracing.server_span(method, metadata, system) as span:
        try:
            yield
        except errors.LlamameshError as exc:
            outcome = status.code_for(exc).name
            fields["error"] = exc.message
            if isinstance(exc, errors.QueueOutOfMemory):  # (the other refusals are counted where they are made)
                metrics.rejected(exc)
            raise
        except BaseException as exc:  # logged with its status, then re-raised
            outcome = _other(exc)
            if outcome == "CANCELLED" and fields.get(_DELIVERED):
                outcome = "ok"
            elif outcome == "CANCELLED" and expired():
                outcome = "DEADLINE_EXCEEDED"
            raise
        finally:
            fields.pop(_DELIVERED, None)
            outcome = fields.pop(_OUTCOME, outcome)
            metrics.INFLIGHT.dec()
            tracing.ended(span, outcome)
            _finished(method, outcome, t0, fields)
            _fields.reset(token)
            structlog.contextvars.unbind_contextvars("request_id")


@contextlib.asynccontextmanager
async def _call(method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """One RPC: ``call``, and a domain error ends the RPC with its status."""

    def expired() -> bool:
        left = context.time_remaining()
        return left is not None and left <= DEADLINE_SLACK_S

    try:
        async with call(method, context.invocation_metadata(), expired=expired):
            yield
    except errors.LlamameshError as exc:
        await status.abort(context, exc)  # raises


def rpc(method: str) -> Callable[[F], F]:
    """Wrap an RPC handler, unary or server-streaming (an async generator)::

        @rpc("Generate")
        async def Generate(self, request, context): ...

    A ``LlamameshError`` ends the call with its status (services/status.py); a cancelled call (the
    caller went away) logs CANCELLED and re-raises; anything else is INTERNAL with a fixed message.
    Each call is a span (llamamesh/tracing.py) continuing the caller's W3C ``traceparent``; its log
    lines carry its ``trace_id``."""

    def wrap(handler: F) -> F:
        if inspect.isasyncgenfunction(handler):

            @functools.wraps(handler)
            async def streaming(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with _call(method, context):
                    async for msg in handler(self, request, context):
                        yield msg

            return streaming  # type: ignore[return-value]

        @functools.wraps(handler)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _call(method, context):
                return await handler(self, request, context)
            raise AssertionError("unreachable: a failed call raises")  # for type checkers

        return unary  # type: ignore[return-value]

    return wrap
