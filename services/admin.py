"""AdminService: what this gateway knows about its backend pools (breakers, live workers, queue depth,
tokens per second)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from llamamesh import errors
from llamamesh.queue.protocol import AdapterRegistry, QueueDepth
from llamamesh.types import ADAPTER_NAME, ModelInfo, WorkerStatus
from llamamesh.v1 import admin_pb2 as pb
from llamamesh.v1 import admin_pb2_grpc
from services.backends import Backends
from services.calls import rpc
from services.convert import resolve_model
from services.pool import Pool

# LoadAdapterRequest.wait_s, at most.
MAX_ADAPTER_WAIT_S = 600


def backend_pb(pool: Pool, fallback: str, depth: QueueDepth | None = None) -> pb.Backend:
    out = pb.Backend(
        pool=pool.name,
        breaker_state=pool.breaker.state.value,
        serving=pool.serving(),
        fallback=fallback,
        probes=pool.probes,
        last_probe_error=pool.last_probe_error,
        queue_wait_s=pool.queue_wait_s if pool.waits else 0.0,
        tokens_per_s=pool.tokens.per_s(),
    )
    if depth is not None:
        out.queue_depth, out.queue_pending = depth.waiting, depth.leased
    for w in pool.workers:
        added = out.workers.add(
            name=w.worker,
            model=w.model,
            engine=w.engine,
            inflight=w.inflight,
            max_inflight=w.max_inflight,
            running=w.running,
            waiting=w.waiting,
            kv_cache_usage=w.kv_cache_usage,
            state=w.state,
            detail=w.detail,
            adapters=w.adapters,
            adapter_errors=w.adapter_errors,
        )
        if w.since_unix_s:
            added.since.FromNanoseconds(int(w.since_unix_s * 1e9))
    for t in pool.breaker.transitions:
        at = Timestamp()
        at.FromNanoseconds(int(t.at_unix_s * 1e9))
        out.transitions.add(at=at, from_state=t.old.value, to_state=t.new.value, reason=t.reason)
    return out


def _serves(w: WorkerStatus, name: str, path: str) -> bool:
    """Whether worker ``w`` serves adapter ``name`` from ``path``: an adapter registered again from
    another folder counts once the worker swapped it (its own adapter of that name counts as is)."""
    if name not in w.adapters:
        return False
    loaded = [p.partition("=")[2] for p in w.adapter_paths if p.partition("=")[0] == name]
    return not loaded or loaded[0] == path


def _wait_until(request: pb.LoadAdapterRequest | pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext) -> float:
    """The loop time by which LoadAdapter / UnloadAdapter answer: ``wait_s`` (default 60, at most
    MAX_ADAPTER_WAIT_S) from now, and within the caller's deadline."""
    wait_s: float = min(request.wait_s if request.HasField("wait_s") else 60, MAX_ADAPTER_WAIT_S)
    remaining = context.time_remaining()
    if remaining is not None:
        wait_s = max(0.0, min(wait_s, remaining - 0.25))
    return asyncio.get_running_loop().time() + wait_s


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        backends: Backends,
        registry: AdapterRegistry | None = None,
        models: Sequence[ModelInfo] = (),
        poll_s: float = 0.2,
    ) -> None:
        """``registry``: where run-time LoRA adapters are recorded per pool (the queue); ``models``: the
        models this gateway routes (LoadAdapter names one)."""
        self._backends = backends
        self._registry = registry
        self._models = tuple(models)
        self._poll_s = poll_s

    def _target(self, model: str, adapter: str) -> tuple[str, AdapterRegistry]:
        if self._registry is None or not self._models:
            raise errors.FailedPrecondition("this gateway has no adapter registry")
        if not ADAPTER_NAME.match(adapter):
            raise errors.InvalidRequest.field("adapter", "1-64 characters of A-Z a-z 0-9 . _ -")
        return resolve_model(model, self._models).pool, self._registry

    @rpc("LoadAdapter")
    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        """Record the adapter for the pool; its workers load it at their next heartbeat. Returns once
        every ready worker serves it, or at ``wait_s`` / the deadline with the rest ``pending``; a
        worker's refusal is the caller's error (and the record goes)."""
        pool, registry = self._target(request.model, request.adapter)
        if not request.path or len(request.path) > 4096 or "\x00" in request.path:
            raise errors.InvalidRequest.field(
                "path", "the adapter folder, as the workers see it (at most 4096 characters)"
            )
        name = request.adapter
        until = _wait_until(request, context)
        await registry.set_adapter(pool, name, request.path)
        loop = asyncio.get_running_loop()
        while True:
            workers = [w for w in self._backends.pools[pool].workers if w.ready]
            key = f"{name}={request.path}: "  # (a worker's earlier refusal of another path does not count)
            refused = [e for w in workers for e in w.adapter_errors if e.startswith(key)]
            if refused:
                await registry.drop_adapter(pool, name)
                why = refused[0].removeprefix(key)
                raise errors.InvalidRequest.field("path", f"a worker of pool {pool!r} could not load it: {why}")
            have = [w.worker for w in workers if _serves(w, name, request.path)]
            pending = [w.worker for w in workers if not _serves(w, name, request.path)]
            # No ready worker: nothing to wait for (workers load it when they come).
            if not pending or loop.time() >= until:
                return pb.LoadAdapterResponse(workers=have, pending=pending)
            await asyncio.sleep(self._poll_s)

    @rpc("UnloadAdapter")
    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        """Drop the adapter from the pool's record; its workers unload it at their next heartbeat (one
        that requests still use, once they end). Returns once no ready worker serves it, or at
        ``wait_s`` / the deadline with those that still do in ``pending``."""
        pool, registry = self._target(request.model, request.adapter)
        if request.adapter not in await registry.adapters(pool):
            raise errors.NotFound(f"adapter {request.adapter!r} was not loaded into pool {pool!r} at run time")
        until = _wait_until(request, context)
        await registry.drop_adapter(pool, request.adapter)
        loop = asyncio.get_running_loop()
        while True:
            workers = self._backends.pools[pool].workers
            pending = [w.worker for w in workers if w.ready and request.adapter in w.adapters]
            if not pending or loop.time() >= until:
                return pb.UnloadAdapterResponse(pending=pending)
            await asyncio.sleep(self._poll_s)

    @rpc("ListBackends")
    async def ListBackends(
        self, request: pb.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBackendsResponse:
        b = self._backends
        pools = sorted(b.pools.items())
        depths = await asyncio.gather(*(b.queue_depth(name) for name, _p in pools))
        return pb.ListBackendsResponse(
            backends=[backend_pb(p, b.fallback.get(name, ""), d) for (name, p), d in zip(pools, depths, strict=True)]
        )
