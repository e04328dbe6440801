"""``llamamesh top --once`` (a real subprocess) against an in-process gateway over a real Redis with a
worker on the slow fake engine, more requests than it has slots: the pool, its ready worker, the
requests in flight, the jobs queued behind them and a closed breaker."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest

from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import GatewaySettings, RedisSettings, WorkerSettings
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services.server import start_gateway
from tests.stacks import stop_in_process
from tests.waiting import until
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

SLOTS = 2
REQUESTS = 6


async def top_once(address: str) -> str:
    """One frame of ``llamamesh top --once``, run as its own process (the gateway here keeps serving)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llamamesh.cli",
        "top",
        "--once",
        "--address",
        address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def busy(frame: str) -> bool:
    """Every slot in flight, jobs queued behind them and tokens counted, as the frame shows the pool."""
    row = cells(frame, "cpu")
    inflight, _slots = map(int, row["INFLIGHT/SLOTS"].split("/"))
    return inflight == SLOTS and int(row["QUEUED"]) > 0 and float(row["TOK/S"]) > 0


def cells(frame: str, first: str) -> dict[str, str]:
    """The pool line starting with ``first``, by column (the frame's POOL header)."""
    lines = frame.splitlines()
    header = next(ln for ln in lines if ln.startswith("POOL "))
    row = next(ln for ln in lines if ln.split() and ln.split()[0] == first)
    return dict(zip(header.split(), row.split(), strict=True))


async def test_top_shows_a_busy_pool(redis_settings: RedisSettings) -> None:
    gw_queue, w_queue = RedisQueue.from_settings(redis_settings), RedisQueue.from_settings(redis_settings)
    # No slot kept for other tenants (tenant_headroom): one tenant fills them all.
    ws = WorkerSettings(
        pool="cpu",
        model="tiny",
        engine="fake",
        max_inflight=SLOTS,
        tenant_headroom=0,
        fake_step_s=0.05,
        consumer="w-top",
    )
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, w_queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    gw = await start_gateway(gw_queue, GatewaySettings(port=0, models="tiny=cpu", max_tokens_cap=512), port=0)
    address = f"127.0.0.1:{gw.port}"
    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)

    async def generate(i: int) -> None:
        async for _m in stub.Generate(pb.GenerateRequest(request_id=f"top-{i}", prompt="x", max_tokens=400)):
            pass

    calls: list[asyncio.Task[None]] = []
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        calls = [asyncio.create_task(generate(i)) for i in range(REQUESTS)]
        # The gateway learns the worker's figures from its heartbeat (each second), and counts tokens
        # per whole second.
        frame = await until(lambda: top_once(address), 20, "top to show the pool busy", done=busy, poll_s=0.2)
        row = cells(frame, "cpu")
        inflight, slots = map(int, row["INFLIGHT/SLOTS"].split("/"))
        assert row["BREAKER"] == "closed" and row["SERVING"] == "yes", frame
        assert (row["READY"], row["STARTING"], row["FAILED"]) == ("1", "0", "0"), frame
        assert (inflight, slots) == (SLOTS, SLOTS), frame
        assert int(row["QUEUED"]) >= REQUESTS - SLOTS, frame  # the rest wait unleased (and probes)
        assert int(row["LEASED"]) == SLOTS, frame
        worker_line = next(ln for ln in frame.splitlines() if ln.split() and ln.split()[0] == "w-top")
        assert worker_line.split()[1:5] == ["ready", "fake", "tiny", f"{SLOTS}/{SLOTS}"], frame
        assert float(row["TOK/S"]) > 0, frame  # relayed tokens, the mean of the last whole seconds
        assert not any(c.done() for c in calls)  # they were all still being served or waiting
    finally:
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await channel.close()
        await stop_in_process(stop, task, gw, engine, gw_queue, w_queue)
