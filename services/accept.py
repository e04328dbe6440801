"""More than one new call accepted at a time (``Acceptors``): ``n`` more requests for calls kept
outstanding per registered method, each handing its call to grpc's own handler path. It uses
private parts of grpc.aio's Cython layer, written against the grpcio pinned in
requirements/lock.txt and checked at start (``supported``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

# The private entry points and the argument names this module calls them with.
_SIGNATURES = {
    "_handle_rpc": ("method_name", "method_resolver", "interceptors", "rpc_state", "loop", "concurrency_exceeded"),
    "_schedule_rpc_coro": ("rpc_coro", "rpc_state", "loop", "method_name"),
}


def _cygrpc() -> Any:
    from grpc._cython import cygrpc

    return cygrpc


def supported() -> str:
    """Empty when this grpcio has the private API ``Acceptors`` needs; else what is missing."""
    try:
        cy = _cygrpc()
    except ImportError as exc:  # pragma: no cover - grpcio always ships it
        return f"grpc._cython.cygrpc: {exc}"
    for name, args in _SIGNATURES.items():
        code = getattr(getattr(cy, name, None), "__code__", None)
        if code is None or tuple(code.co_varnames[: code.co_argcount]) != args:
            return f"cygrpc.{name}{args}"
    for name in ("_request_registered_call", "is_running"):
        if not hasattr(getattr(cy, "AioServer", None), name):
            return f"cygrpc.AioServer.{name}"
    if not hasattr(cy, "_MethodResolver"):
        return "cygrpc._MethodResolver"
    return ""


class Acceptors:
    """``n`` extra outstanding call requests per registered method of ``server``.

    Why: grpc.aio's server asks gRPC core for the next call of a method only once the previous one
    has been handed to its handler, at a cost of several turns of the event loop; under load a burst
    of new calls is then accepted a few per turn. Each call accepted here takes grpc's own handler
    path (the same method resolution, interceptors, cancellation watch and exception handling):
    ``server.stop(grace)`` drains them like any call, and its shutdown ends the acceptors.

    Build it right after ``grpc.aio.server(interceptors=...)`` with the same interceptors (it records
    the handlers as they are added), ``start()`` it after ``server.start()``, and ``stop()`` it after
    ``server.stop()``. The server must not be given ``maximum_concurrent_rpcs`` (grpc's limiter is
    not consulted here; the gatekeeper bounds concurrent calls). ``n`` 0, or a grpcio without the
    private API: nothing is added (the gateway then logs ``grpc_acceptors_unavailable`` and accepts
    as grpc's own loop does: correct, only slower to accept bursts)."""

    def __init__(self, server: grpc.aio.Server, interceptors: Sequence[Any], n: int) -> None:
        if n < 0:
            raise ValueError(f"LLAMAMESH_GATEWAY_ACCEPTORS must be 0 or more, not {n}")
        self._server = server
        self._interceptors = tuple(interceptors)
        self.missing = supported() if n else ""
        self.n = 0 if self.missing else n
        self._generic: list[Any] = []
        self._registered: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self.accepted = 0  # calls these acceptors handed to their handlers
        if self.n:
            add_generic, add_registered = server.add_generic_rpc_handlers, server.add_registered_method_handlers

            def generic(handlers: Sequence[grpc.GenericRpcHandler]) -> None:
                add_generic(handlers)
                self._generic.extend(handlers)

            def registered(service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
                add_registered(service, handlers)
                self._registered.update({f"/{service}/{m}": h for m, h in handlers.items()})

            server.add_generic_rpc_handlers = generic  # type: ignore[method-assign]
            server.add_registered_method_handlers = registered  # type: ignore[method-assign]

    def start(self) -> None:
        """Start the acceptors (the server must be started). Logs which path accepts calls."""
        if self.missing:
            log.warning("grpc_acceptors_unavailable", grpcio=grpc.__version__, missing=self.missing)
        if not self.n:
            return
        cy = _cygrpc()
        loop = asyncio.get_running_loop()
        resolver = cy._MethodResolver(self._generic, self._registered)
        for method in self._registered:
            for i in range(self.n):
                task = loop.create_task(self._accept(cy, method, resolver, loop), name=f"acceptor-{method}-{i}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _accept(self, cy: Any, method: str, resolver: Any, loop: asyncio.AbstractEventLoop) -> None:
        aio = self._server._server  # type: ignore[attr-defined]  # grpc.aio.Server's cygrpc.AioServer
        name = method.encode()
        while True:
            try:
                rpc_state = await aio._request_registered_call(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server is shutting down (its shutdown fails the request)
                if aio.is_running():
                    log.warning("grpc_acceptor_ended", method=method, error=f"{type(exc).__name__}: {exc}")
                return
            self.accepted += 1
            rpc = cy._handle_rpc(method, resolver, self._interceptors, rpc_state, loop, False)
            call = loop.create_task(cy._schedule_rpc_coro(rpc, rpc_state, loop, method), name="rpc_task")
            self._calls.add(call)  # the loop keeps only a weak reference to a task
            call.add_done_callback(self._calls.discard)

    @property
    def running(self) -> int:
        """Acceptor tasks still waiting for calls."""
        return len(self._tasks)

    async def stop(self) -> None:
        """After ``server.stop()``: the acceptors have ended (its shutdown failed their requests);
        cancel any left, and wait for the calls they accepted (already drained by the stop)."""
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, *self._calls, return_exceptions=True)
