"""In-process gateway on port 0 over the in-memory queue, with a real Worker on the fake engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.v1 import generation_pb2_grpc
from services.server import Gateway, start_gateway
from workers.engines.fake import FakeEngine
from workers.worker import Worker


@dataclass
class Stack:
    queue: MemoryQueue
    gateway: Gateway
    engine: FakeEngine
    worker: Worker
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationServiceStub


@pytest.fixture
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    marker = request.node.get_closest_marker("fake_step_s")
    step = marker.args[0] if marker else 0.0
    queue = MemoryQueue()
    gw_settings = GatewaySettings(port=0, max_tokens_cap=512, default_max_tokens=16, models="tiny=cpu,other=gpu")
    gateway = await start_gateway(queue, gw_settings, port=0)
    w_settings = WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=8, fake_step_s=step)
    engine = FakeEngine(w_settings)
    await engine.start()
    worker = Worker(w_settings, queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(worker.ready.wait(), 5)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield Stack(queue, gateway, engine, worker, channel, generation_pb2_grpc.GenerationServiceStub(channel))
    finally:
        await channel.close()
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await gateway.stop(0)
        await engine.shutdown()
