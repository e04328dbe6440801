"""A canary split through a real gateway: gRPC on loopback, redis-server, one fake-engine worker
per side. 10 000 Generate calls with distinct request ids land on the two pools within 1 % of the
weights, each on the side its id hashes to; the same ids sent through a second gateway (its own
queue) land exactly where they did."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import GatewaySettings, RedisSettings, WorkerSettings
from llamamesh.types import GenerationRequest, TokenDelta
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services.routing import RoutingPolicy
from services.server import start_gateway
from tests.stacks import stop_in_process
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]

ROUTES = "model == m -> vllm=95, vllm-canary=5"
SIDES = ("vllm", "vllm-canary")


class Recording(FakeEngine):
    """The fake engine, keeping every request id it served (its own list keeps the last 1000)."""

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.ids: list[str] = []

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not request.request_id.startswith("probe~"):  # the gateway's health probes
            self.ids.append(request.request_id)
        async for delta in super().stream(request):
            yield delta


async def served_by(redis_settings: RedisSettings, ids: list[str]) -> dict[str, str]:
    """Send one Generate per id through a fresh gateway and workers; the pool that served each."""
    gw_queue = RedisQueue.from_settings(redis_settings)
    stacks = []
    for pool in SIDES:
        ws = WorkerSettings(pool=pool, model="m", engine="fake", max_inflight=64, consumer=f"w-{pool}")
        engine = Recording(ws)
        await engine.start()
        queue = RedisQueue.from_settings(redis_settings)
        worker = Worker(ws, queue, engine, block_ms=100)
        stop = asyncio.Event()
        stacks.append((pool, engine, queue, worker, stop, asyncio.create_task(worker.run(stop))))
    settings = GatewaySettings(port=0, models="m=vllm", routes=ROUTES)
    gw = await start_gateway(gw_queue, settings, port=0)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") for _ in range(4)]
    try:
        for s in stacks:
            await asyncio.wait_for(s[3].ready.wait(), 10)
        sem = asyncio.Semaphore(128)

        async def one(i: int, request_id: str) -> None:
            stub = generation_pb2_grpc.GenerationServiceStub(channels[i % len(channels)])
            async with sem:
                req = pb.GenerateRequest(request_id=request_id, model="m", prompt="x", max_tokens=1)
                replies = [m async for m in stub.Generate(req, timeout=60)]
            assert replies[-1].usage.completion_tokens == 1

        await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in enumerate(ids))), 180)
        out = {rid: pool for pool, engine, *_ in stacks for rid in engine.ids}
        assert len(out) == len(ids) == sum(len(s[1].ids) for s in stacks), "each request served once, by one side"
        return out
    finally:
        for c in channels:
            await c.close()
        await gw.stop(0)
        await gw_queue.close()
        for _pool, engine, queue, _worker, stop, task in stacks:
            await stop_in_process(stop, task, _NoGateway(), engine, queue)


class _NoGateway:
    async def stop(self, _grace: float) -> None:
        pass


@pytest.mark.parametrize("redis_server", ["redis"], indirect=True)  # routing is the gateway's: one server kind
async def test_four_thousand_requests_split_by_weight_and_each_id_always_one_way(redis_settings: RedisSettings) -> None:
    ids = [f"canary-{i}" for i in range(4_000)]
    pools = await served_by(redis_settings, ids)
    share = sum(1 for p in pools.values() if p == "vllm-canary") / len(ids)
    assert abs(share - 0.05) <= 0.01, share
    policy = RoutingPolicy.parse(ROUTES)
    expected = {rid: policy.choose(GenerationRequest(request_id=rid, model="m", prompt="x"), "vllm")[0] for rid in ids}
    assert pools == expected  # the side is the id's: what any gateway would choose for it
    # The same ids again, through another gateway with a queue of its own: the same sides.
    again = await served_by(replace(redis_settings, prefix=f"test:{uuid.uuid4().hex[:10]}"), ids[:500])
    assert again == {rid: pools[rid] for rid in ids[:500]}
