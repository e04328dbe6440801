"""The gateway routes by the configured rules: in-process gateway, in-memory queue, one fake-engine
worker per pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.types import GenerationRequest, SamplingParams
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services.relay import resumed
from services.server import start_gateway
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def routed() -> AsyncIterator[tuple[generation_pb2_grpc.GenerationServiceStub, dict[str, FakeEngine]]]:
    queue = MemoryQueue()
    settings = GatewaySettings(port=0, models="tiny=cpu", routes="temperature == 0 -> fast; meta.tier == gold -> gold")
    gateway = await start_gateway(queue, settings, port=0)
    engines: dict[str, FakeEngine] = {}
    stop = asyncio.Event()
    tasks = []
    for pool in ("cpu", "fast", "gold"):
        ws = WorkerSettings(pool=pool, model="tiny", engine="fake", consumer=f"w-{pool}")
        engines[pool] = FakeEngine(ws)
        await engines[pool].start()
        worker = Worker(ws, queue, engines[pool], block_ms=100)
        tasks.append(asyncio.create_task(worker.run(stop)))
        await asyncio.wait_for(worker.ready.wait(), 5)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield generation_pb2_grpc.GenerationServiceStub(channel), engines
    finally:
        await channel.close()
        stop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)
        await gateway.stop(0)


async def test_requests_go_where_the_rules_say(routed) -> None:  # type: ignore[no-untyped-def]
    stub, engines = routed
    cases = {
        "greedy": (pb.GenerateRequest(request_id="greedy", prompt="a b", max_tokens=2, temperature=0.0), "fast"),
        "sampled": (pb.GenerateRequest(request_id="sampled", prompt="a b", max_tokens=2, temperature=0.7), "cpu"),
        "gold": (pb.GenerateRequest(request_id="gold", prompt="a b", max_tokens=2, metadata={"tier": "gold"}), "gold"),
    }
    for rid, (request, pool) in cases.items():
        msgs = [m async for m in stub.Generate(request)]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert [p for p, e in engines.items() if rid in e.served] == [pool], rid


async def test_a_bad_rule_stops_the_gateway_from_starting() -> None:
    with pytest.raises(ValueError, match="unknown field 'temp'"):
        await start_gateway(MemoryQueue(), GatewaySettings(port=0, models="tiny=cpu", routes="temp == 0 -> x"), port=0)


def test_a_resumed_attempt_asks_for_the_rest_only() -> None:
    req = GenerationRequest(
        request_id="r", model="m", prompt="p", sampling=SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0)
    )
    again = resumed(req, 1, [])
    assert again.request_id == "r~1" and again.resume_token_ids == () and again.sampling == req.sampling
    later = resumed(req, 2, [5, 6, 7, 8, 9, 10])
    assert later.request_id == "r~2" and later.resume_token_ids == (5, 6, 7, 8, 9, 10)
    assert later.sampling.max_tokens == 4 and later.sampling.min_tokens == 0 and later.sampling.temperature == 0.0
