"""AdminService: what this gateway knows about its backend pools (breakers, live workers, queue depth,
tokens per second)."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from llamamesh.queue.protocol import QueueDepth
from llamamesh.v1 import admin_pb2 as pb
from llamamesh.v1 import admin_pb2_grpc
from services.backends import Backends, Pool
from services.calls import rpc


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
            name=w.worker, model=w.model, engine=w.engine, inflight=w.inflight, max_inflight=w.max_inflight,
            running=w.running, waiting=w.waiting, kv_cache_usage=w.kv_cache_usage, state=w.state, detail=w.detail,
        )  # fmt: skip
        if w.since_unix_s:
            added.since.FromNanoseconds(int(w.since_unix_s * 1e9))
    for t in pool.breaker.transitions:
        at = Timestamp()
        at.FromNanoseconds(int(t.at_unix_s * 1e9))
        out.transitions.add(at=at, from_state=t.old.value, to_state=t.new.value, reason=t.reason)
    return out


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, backends: Backends) -> None:
        self._backends = backends

    @rpc("ListBackends")
    async def ListBackends(
        self, request: pb.ListBackendsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBackendsResponse:
        b = self._backends
        pools = sorted(b.pools.items())
        depths = await asyncio.gather(*(b.queue_depth(name) for name, _p in pools))
        return pb.ListBackendsResponse(backends=[
            backend_pb(p, b.fallback.get(name, ""), d) for (name, p), d in zip(pools, depths, strict=True)
        ])  # fmt: skip
