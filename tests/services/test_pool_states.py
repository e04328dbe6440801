"""What the gateway does with a pool's workers' states (in-process gateway over the in-memory queue):
a starting pool is coming up (requests wait, the breaker stays closed), a pool starting for too
long or whose workers failed says why, and a request whose workers keep dying is set aside."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import structlog.testing

from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import BreakerSettings, GatewaySettings, WorkerSettings
from llamamesh.types import WorkerStatus
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.services.conftest import Config, Workers, running, serving
from tests.waiting import until
from workers.engines.fake import FakeEngine

pytestmark = pytest.mark.timeout(30)

FAST = BreakerSettings(probe_interval_s=0.1, probe_timeout_s=1.0)


@contextlib.asynccontextmanager
async def gateway(queue: MemoryQueue, **settings: object) -> AsyncIterator[pb_grpc.GenerationServiceStub]:
    """A gateway of model m (pool gpu) over ``queue``, probing every 0.1 s, without workers of its own."""
    config = Config(
        gateway=GatewaySettings(port=0, models="m=gpu", **settings),  # type: ignore[arg-type]
        breaker=FAST,
        workers=(),
        queue=lambda: queue,
    )
    async with running(config) as stack:
        yield stack.stub


def workers(queue: MemoryQueue, *names: str) -> contextlib.AbstractAsyncContextManager[Workers]:
    """Workers of pool gpu named ``names`` over ``queue``, ready."""
    ws = [WorkerSettings(pool="gpu", engine="fake", consumer=n, fake_step_s=0.01, heartbeat_s=0.05) for n in names]
    return serving(queue, ws, Config(block_ms=50, ready_s=10))


async def test_a_request_to_a_starting_pool_waits_and_is_served_once_it_is_ready() -> None:
    queue = MemoryQueue()
    await queue.heartbeat(WorkerStatus("w1", "gpu", state="starting", detail="converting the model"), ttl_s=60)
    async with gateway(queue, no_worker_wait_s=0.3, start_wait_s=30) as stub:
        call = stub.Generate(pb.GenerateRequest(prompt="patience", max_tokens=3), timeout=20)

        async def read_all() -> list[pb.GenerateResponse]:
            return [m async for m in call]

        reading = asyncio.ensure_future(read_all())
        # Time passing on purpose: past no_worker_wait_s (0.3), a starting pool is not an empty one.
        await asyncio.sleep(1.0)
        assert not reading.done()
        async with workers(queue, "w1"):
            msgs = await asyncio.wait_for(reading, 10)
        assert [t for m in msgs for t in m.token_ids] and msgs[-1].finish_reason


async def test_a_pool_starting_for_longer_than_start_wait_is_unavailable_saying_what_it_does() -> None:
    queue = MemoryQueue()
    await queue.heartbeat(WorkerStatus("w1", "gpu", state="starting", detail="loading the model"), ttl_s=60)
    async with gateway(queue, start_wait_s=0.5) as stub:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=3), timeout=20).read()
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        assert ei.value.details() == (
            "the backend pool 'gpu' has been starting for over 0.5 s (worker w1 is starting: loading the model)"
        )
        assert time.monotonic() - t0 < 5


async def test_a_pool_whose_worker_failed_to_start_says_why() -> None:
    queue = MemoryQueue()
    why = "cannot load model /models/x.gguf: FileNotFoundError: no such file"
    await queue.heartbeat(WorkerStatus("w1", "gpu", state="failed", detail=why), ttl_s=60)
    async with gateway(queue, no_worker_wait_s=0.3) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=3), timeout=20).read()
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE
        assert why in (ei.value.details() or "") and "no live worker" in (ei.value.details() or "")


async def test_a_request_that_kills_two_workers_is_not_sent_to_a_third() -> None:
    """Its engine dies under it twice (a request that crashes engines): the second death ends it
    INTERNAL with what happened, it is recorded in the dead-letter stream, the third worker never
    sees it and serves the next request."""
    queue = MemoryQueue()
    async with workers(queue, "w1", "w2", "w3") as ws, gateway(queue, failover_attempts=5) as stub:
        got: list[pb.GenerateResponse] = []

        async def read() -> None:
            async for m in stub.Generate(pb.GenerateRequest(prompt="__die__ now", max_tokens=20), timeout=20):
                got.append(m)  # its first token came before each death

        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await read()
        code, details = ei.value.code(), ei.value.details() or ""
        assert code is grpc.StatusCode.INTERNAL, (code, details)
        assert details.startswith("the request was set aside: 2 workers died running it"), details
        assert len(queue.dead) == 1 and queue.dead[0][3] == 2
        served = [e.served for e in ws.engines]  # type: ignore[attr-defined]
        assert sorted(len(s) for s in served) == [0, 1, 1], served  # two attempts, on two workers
        survivor = next(w for w, s in zip(ws.workers, served, strict=True) if not s)
        msgs = [m async for m in stub.Generate(pb.GenerateRequest(prompt="fine", max_tokens=3))]
        assert msgs[-1].finish_reason and survivor.engine_died is None


async def test_a_default_tenants_backlog_does_not_hold_up_the_probes() -> None:
    """Every slot of the pool's one worker busy with the default tenant's requests and more of them
    queued: the gateway's probes (their own work stream) start in the worker's tenant headroom, so
    they keep answering and the pool's breaker stays closed."""
    queue = MemoryQueue()
    ws = WorkerSettings(pool="gpu", engine="fake", consumer="w1", fake_step_s=0.02, heartbeat_s=0.05, max_inflight=2)
    with structlog.testing.capture_logs() as logs:
        async with serving(queue, [ws], Config(block_ms=50, ready_s=10)) as fleet, gateway(queue) as stub:
            calls = [
                stub.Generate(pb.GenerateRequest(prompt=f"busy {i}", max_tokens=400), timeout=30) for i in range(6)
            ]
            engine = fleet.engines[0]
            assert isinstance(engine, FakeEngine)
            probes = lambda: sum(r.startswith("probe~") for r in engine.served)  # noqa: E731
            before = probes()
            await until(lambda: probes() >= before + 8, 20, "8 probes behind the backlog")
            for c in calls:
                c.cancel()
    assert not [e for e in logs if e["event"] in ("breaker_transition", "probe_failed")]
