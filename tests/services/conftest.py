"""The in-process gateway of the services tests: gateways on port 0 over the in-memory queue, with
real Workers on the fake engine (or the engine a test gives), driven through gRPC.

``running(config)`` starts one such stack and stops it all at the end. The ``stack`` fixture is the
one of the ``Config`` given as its indirect parameter, else of the test module's ``STACK``, else the
default one; its workers' fake engines step ``fake_step_s`` seconds when the test is so marked.
``serving(queue, workers)`` runs workers alone, for a test that starts them beside its gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import pytest

from llamamesh.queue.memory import MemoryBatches, MemoryFiles, MemoryQueue
from llamamesh.settings import (
    AuthSettings,
    BatchSettings,
    BreakerSettings,
    GatewaySettings,
    LimitsSettings,
    WorkerSettings,
)
from llamamesh.v1 import admin_pb2_grpc, batch_pb2_grpc, generation_pb2_grpc
from services.server import Gateway, start_gateway
from tests.redisproc import free_port
from workers.engines.base import Engine
from workers.engines.fake import FakeEngine
from workers.worker import Worker

GATEWAY = GatewaySettings(port=0, max_tokens_cap=512, default_max_tokens=16, models="tiny=cpu,other=gpu")
WORKER = WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=8)


@dataclass(frozen=True)
class Config:
    """How a test's stack differs from the default one."""

    gateway: GatewaySettings = GATEWAY
    workers: tuple[WorkerSettings, ...] = (WORKER,)
    gateways: int = 1  # over the one queue, the stubs on the first
    queue: Callable[[], MemoryQueue] = MemoryQueue
    batches: bool = False  # a batch store: the batch service runs and the workers take its items
    worker_batch: BatchSettings | None = None
    gateway_batch: BatchSettings | None = None  # the batch service's (default: the settings' defaults)
    breaker: BreakerSettings | None = None
    auth: AuthSettings | None = None
    limits: LimitsSettings | None = None  # every tenant's (no quotas: only the static bounds apply)
    block_ms: int = 100  # the workers' lease wait
    engine: Callable[[WorkerSettings], Engine] = FakeEngine
    ready_s: float = 5.0  # for the workers to be ready

    def stepping(self, step_s: float) -> Config:
        """The same, every worker's fake engine taking ``step_s`` seconds a step."""
        return replace(self, workers=tuple(replace(w, fake_step_s=step_s) for w in self.workers))


@dataclass
class Workers:
    workers: list[Worker]
    engines: list[Engine]
    tasks: list[asyncio.Task[None]]


@dataclass
class Stack:
    config: Config
    queue: MemoryQueue
    gateways: list[Gateway]
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationServiceStub
    running: Workers
    batches: MemoryBatches | None = None
    admin: admin_pb2_grpc.AdminServiceStub = field(init=False)
    batch: batch_pb2_grpc.BatchServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self.batch = batch_pb2_grpc.BatchServiceStub(self.channel)

    @property
    def gateway(self) -> Gateway:
        return self.gateways[0]

    @property
    def workers(self) -> list[Worker]:
        return self.running.workers

    @property
    def worker(self) -> Worker:
        return self.running.workers[0]

    @property
    def engine(self) -> Any:  # the first worker's (a FakeEngine unless the config makes another)
        return self.running.engines[0]

    async def start_gateway(self, port: int = 0, settings: GatewaySettings | None = None) -> Gateway:
        """Another gateway over the stack's queue (its config's settings unless ``settings``)."""
        c = self.config
        return await start_gateway(
            self.queue, settings or c.gateway, port=port, breaker=c.breaker, batches=self.batches, auth=c.auth
        )

    @contextlib.asynccontextmanager
    async def beside(self, settings: GatewaySettings) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
        """A gateway with ``settings`` over the stack's queue (and workers) for the block, and a stub
        for it."""
        gw = await self.start_gateway(settings=settings)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
                yield generation_pb2_grpc.GenerationServiceStub(ch)
        finally:
            await gw.stop(0)


@contextlib.asynccontextmanager
async def serving(
    queue: MemoryQueue,
    settings: Sequence[WorkerSettings],
    config: Config | None = None,
    batches: MemoryBatches | None = None,
) -> AsyncIterator[Workers]:
    """Workers of ``settings`` over ``queue``, ready, for the block; then stopped (each given 10 s)."""
    c = config or Config()
    engines = [c.engine(s) for s in settings]
    workers = [Worker(s, queue, e, c.block_ms, batches, c.worker_batch) for s, e in zip(settings, engines, strict=True)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        await asyncio.wait_for(asyncio.gather(*(w.ready.wait() for w in workers)), c.ready_s)
        yield Workers(workers, engines, tasks)
    finally:
        stop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)
        for e in engines:
            await e.shutdown()


@contextlib.asynccontextmanager
async def running(config: Config | None = None) -> AsyncIterator[Stack]:
    """The stack of ``config`` (default: one gateway and one fake-engine worker of pool cpu)."""
    c = config or Config()
    queue = c.queue()
    batches = MemoryBatches() if c.batches else None
    gateways: list[Gateway] = []
    try:
        for _ in range(c.gateways):
            files = MemoryFiles() if batches is not None else None
            gateways.append(
                await start_gateway(
                    queue,
                    c.gateway,
                    port=0,
                    breaker=c.breaker,
                    batches=batches,
                    batch=c.gateway_batch,
                    auth=c.auth,
                    files=files,
                    limits=c.limits,
                )
            )
        async with (
            serving(queue, c.workers, c, batches) as workers,
            grpc.aio.insecure_channel(f"127.0.0.1:{gateways[0].port}") as channel,
        ):
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            yield Stack(c, queue, gateways, channel, stub, workers, batches)
    finally:
        for gw in gateways:  # (a test may have replaced them: see Stack.start_gateway)
            await gw.stop(0)


@pytest.fixture
async def stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    config: Config = getattr(request, "param", None) or getattr(request.module, "STACK", None) or Config()
    marker = request.node.get_closest_marker("fake_step_s")
    if marker:
        config = config.stepping(marker.args[0])
    async with running(config) as s:
        yield s


@pytest.fixture
async def openai_door() -> AsyncIterator[tuple[Stack, Any]]:
    """The default stack with the batch service and the HTTP door open, and the official ``openai``
    SDK's async client of it."""
    import openai  # (only the HTTP door's tests need it)

    port = free_port()
    async with (
        running(Config(gateway=replace(GATEWAY, http_port=port), batches=True)) as stack,
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield stack, client
