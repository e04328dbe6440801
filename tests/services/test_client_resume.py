"""The Python client resumes a broken stream for its caller (llamamesh/client/resume.py): two in-process
gateways over one queue and a worker on the fake engine; the gateway serving a stream stops
mid-stream, at random points, and the caller's iterator still sees the whole stream once."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from llamamesh.client import Client, SyncClient, by_sample
from llamamesh.client.resume import RESUME_WINDOW_S, Resumption, worth_resuming
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.v1 import generation_pb2 as pb
from tests.services.conftest import Config, Stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


STACK = Config(
    gateway=GatewaySettings(port=0, models="tiny=cpu", max_tokens_cap=512, reattach_grace_s=30),
    workers=(WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=8, fake_step_s=0.005),),
    gateways=2,
    block_ms=50,
)


def target(stack: Stack) -> str:
    """Both gateways behind one channel (pick_first: the first while it answers)."""
    return "ipv4:" + ",".join(f"127.0.0.1:{g.port}" for g in stack.gateways)


async def restart(stack: Stack) -> None:
    """Stop each gateway (the open streams break, whichever holds them), then start it again on its port."""
    for i, gw in enumerate(stack.gateways):
        await gw.stop(0)
        stack.gateways[i] = await stack.start_gateway(port=gw.port)


@pytest.mark.parametrize("seed", range(4))
async def test_a_stream_cut_at_random_points_reads_as_one(stack: Stack, seed: int) -> None:
    rng = random.Random(seed)
    n = 3 if seed % 2 else 1
    fields = {"max_tokens": 300, "seed": 11, "temperature": 0.9, "n": n}
    async with Client(target(stack)) as client:
        ref = [m async for m in client.generate("cut me anywhere", **fields)]
        # each cut comes a random 1-19 of sample 0's tokens after the stream went on from the last:
        # counted in tokens, not messages, since a resumed stream (or a loaded machine) sends the
        # tokens made meanwhile in a few messages; all three well before sample 0's 300th token
        gaps = [rng.randrange(1, 20) for _ in range(3)]
        got: list[pb.GenerateResponse] = []
        broken = seen = 0
        cut = gaps.pop(0)
        async for m in client.generate("cut me anywhere", **fields):
            got.append(m)
            seen += len(m.token_ids) if m.sample == 0 else 0
            if cut and seen >= cut:
                await restart(stack)
                broken += 1
                cut = seen + gaps.pop(0) if gaps else 0
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
    assert got[-1].usage.completion_tokens == n * 300


async def test_the_sync_client_resumes_too(stack: Stack) -> None:
    def run() -> tuple[str, str]:
        with SyncClient(target(stack)) as client:
            ref = client.complete("sync", max_tokens=60, temperature=0)
            text = ""
            for i, m in enumerate(client.generate("sync", max_tokens=60, temperature=0)):
                text += m.text
                if i == 5:
                    asyncio.run_coroutine_threadsafe(restart(stack), loop).result(10)
            return ref, text

    loop = asyncio.get_running_loop()
    ref, text = await asyncio.to_thread(run)
    assert text == ref and len(ref) > 0


async def test_a_stream_waits_out_its_only_gateway_down_for_six_seconds(stack: Stack) -> None:
    """The only gateway it knows is down for 6 s mid-stream (a crash, then a restart): the client
    keeps calling for its resume window, its channel reconnecting every second, and the caller's
    loop reads the whole stream once."""
    port = stack.gateways[0].port

    async def outage() -> None:
        await stack.gateways[0].stop(0)
        await asyncio.sleep(6.0)  # the outage itself
        stack.gateways[0] = await stack.start_gateway(port=port)

    async with Client(f"127.0.0.1:{port}") as client:
        ref = await client.complete("outage", max_tokens=150, temperature=0)
        text, fault = "", None
        async for m in client.generate("outage", max_tokens=150, temperature=0):
            text += m.text
            if fault is None and m.index >= 5:
                fault = asyncio.create_task(outage())
        assert fault is not None and fault.done()
    assert text == ref and len(ref) > 0


async def test_resuming_off_gives_the_caller_the_break(stack: Stack) -> None:
    async def read_past_a_restart(client: Client) -> None:
        async for m in client.generate("no resume", max_tokens=200):
            if m.index >= 5:
                await restart(stack)

    async with Client(target(stack), resume_attempts=0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as broken:
            await read_past_a_restart(client)
        assert broken.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


async def test_stopping_early_cancels_the_request(stack: Stack) -> None:
    async with Client(target(stack)) as client:
        stream = client.generate("stop early", request_id="early-stop", max_tokens=400)
        async for m in stream:
            if m.index >= 3:
                break
        await stream.aclose()

    # Not left running for the re-attach grace.
    await until(lambda: "early-stop" in stack.engine.aborted, 5, "the engine's abort of the stopped request")


async def test_errors_of_the_gateways_own_are_not_resumed(stack: Stack) -> None:
    async with Client(target(stack)) as client:
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            async for _m in client.generate("x", max_tokens=2, temperature=-1):
                pass
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not worth_resuming(bad.value)
    r = Resumption(pb.GenerateRequest(prompt="x"), attempts=2, timeout=None)
    assert r.request.resumable and len(r.request_id) == 32  # sent resumable, under an id of its own


def test_a_broken_stream_is_called_again_for_its_attempts_and_at_least_the_window() -> None:
    now = [0.0]
    r = Resumption(pb.GenerateRequest(prompt="x"), attempts=2, timeout=None, clock=lambda: now[0])
    gone = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")
    waited = 0
    while now[0] < RESUME_WINDOW_S:  # fast failures (nothing listens): still called again
        now[0] += r.backoff(gone) + 0.01
        waited += 1
    assert waited > 2
    with pytest.raises(grpc.aio.AioRpcError):  # past both: the caller gets the error
        r.backoff(gone)
