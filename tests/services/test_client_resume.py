"""The Python client resumes a broken stream for its caller (llamamesh/resume.py): two in-process
gateways over one queue and a worker on the fake engine; the gateway serving a stream stops
mid-stream, at random points, and the caller's iterator still sees the whole stream once."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from llamamesh.client import Client, SyncClient, by_sample
from llamamesh.queue.memory import MemoryQueue
from llamamesh.resume import Resumption, worth_resuming
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.v1 import generation_pb2 as pb
from services.server import Gateway, start_gateway
from tests.stacks import stop_in_process
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = pytest.mark.timeout(60)


@dataclass
class Pair:
    queue: MemoryQueue
    gateways: list[Gateway]
    engine: FakeEngine

    @property
    def target(self) -> str:
        """Both gateways behind one channel (pick_first: the first while it answers)."""
        return "ipv4:" + ",".join(f"127.0.0.1:{g.port}" for g in self.gateways)

    async def restart(self) -> None:
        """Stop both gateways at once (the open streams break, whichever holds them), then start
        them again on their ports."""
        for i, gw in enumerate(self.gateways):
            await gw.stop(0)
            self.gateways[i] = await start_gateway(self.queue, settings(), port=gw.port)


def settings() -> GatewaySettings:
    return GatewaySettings(port=0, models="tiny=cpu", max_tokens_cap=512, reattach_grace_s=30)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    queue = MemoryQueue()
    gateways = [await start_gateway(queue, settings(), port=0) for _ in range(2)]
    ws = WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=8, fake_step_s=0.005)
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, queue, engine, block_ms=50)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(worker.ready.wait(), 5)
    p = Pair(queue, gateways, engine)
    try:
        yield p
    finally:
        await stop_in_process(stop, task, p.gateways[1], engine)
        await p.gateways[0].stop(0)


@pytest.mark.parametrize("seed", range(4))
async def test_a_stream_cut_at_random_points_reads_as_one(pair: Pair, seed: int) -> None:
    rng = random.Random(seed)
    n = 3 if seed % 2 else 1
    fields = {"max_tokens": 120, "seed": 11, "temperature": 0.9, "n": n}
    async with Client(pair.target) as client:
        ref = [m async for m in client.generate("cut me anywhere", **fields)]
        cuts = sorted(rng.sample(range(1, 40), 3))
        got: list[pb.GenerateResponse] = []
        broken = 0
        async for m in client.generate("cut me anywhere", **fields):
            got.append(m)
            if cuts and len(got) == cuts[0]:
                cuts.pop(0)
                await pair.restart()
                broken += 1
    assert broken == 3, f"seed {seed}: the stream ended after {len(got)} messages"
    assert by_sample(got, n) == by_sample(ref, n)  # the text of each sample, uninterrupted
    for k in range(n):
        ids = [t for m in got if m.sample == k for t in m.token_ids]
        assert ids == [t for m in ref if m.sample == k for t in m.token_ids]
        at = 0
        for m in (m for m in got if m.sample == k and m.token_ids):  # contiguous, no repeat
            assert m.index == at
            at += len(m.token_ids)
        assert sum(1 for m in got if m.sample == k and m.finish_reason) == 1  # each sample ends once
    assert got[-1].usage.completion_tokens == n * 120


async def test_the_sync_client_resumes_too(pair: Pair) -> None:
    def run() -> tuple[str, str]:
        with SyncClient(pair.target) as client:
            ref = client.complete("sync", max_tokens=60, temperature=0)
            text = ""
            for i, m in enumerate(client.generate("sync", max_tokens=60, temperature=0)):
                text += m.text
                if i == 5:
                    asyncio.run_coroutine_threadsafe(pair.restart(), loop).result(10)
            return ref, text

    loop = asyncio.get_running_loop()
    ref, text = await asyncio.to_thread(run)
    assert text == ref and len(ref) > 0


async def test_resuming_off_gives_the_caller_the_break(pair: Pair) -> None:
    async def read_past_a_restart(client: Client) -> None:
        async for m in client.generate("no resume", max_tokens=200):
            if m.index >= 5:
                await pair.restart()

    async with Client(pair.target, resume_attempts=0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            await read_past_a_restart(client)
        assert broken.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


async def test_stopping_early_cancels_the_request(pair: Pair) -> None:
    async with Client(pair.target) as client:
        stream = client.generate("stop early", request_id="early-stop", max_tokens=400)
        async for m in stream:
            if m.index >= 3:
                break
        await stream.aclose()

    async def aborted() -> None:
        while "early-stop" not in pair.engine.aborted:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    await asyncio.wait_for(aborted(), 5)  # not left running for the re-attach grace


async def test_errors_of_the_gateways_own_are_not_resumed(pair: Pair) -> None:
    async with Client(pair.target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _m in client.generate("x", max_tokens=2, temperature=-1):
                pass
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not worth_resuming(bad.value)
    r = Resumption(pb.GenerateRequest(prompt="x"), attempts=2, timeout=None)
    assert r.request.resumable and len(r.request_id) == 32  # sent resumable, under an id of its own
