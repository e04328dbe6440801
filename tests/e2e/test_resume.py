"""Streams that outlive their gateway, through the public contract: the Python client (streams sent
resumable, re-attached on UNAVAILABLE through whichever gateway behind its channel answers) reads a
stream while the gateway carrying it is killed with kill -9 at random points, each time resuming
through the other gateway. The caller's stream is the uninterrupted one: the same text and token ids
of every sample, indexes contiguous, each sample ending once. On the fake engine (several streams,
n > 1 too) and on the real CPU model."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamamesh.client import Client, by_sample, serving
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess, free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


class TwoGateways:
    """Two more gateway processes of ``node`` (its Redis and prefix), behind one client channel."""

    def __init__(self, node: ProcessNode) -> None:
        self.node = node
        self.ports = [free_port(), free_port()]
        for i in range(2):
            self.start(i)

    @property
    def target(self) -> str:
        # pick_first: the first address that answers, kept while it answers.
        return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, i: int) -> None:
        self.node.spawn(
            f"gateway{i}",
            "services",
            LLAMAMESH_GATEWAY_PORT=str(self.ports[i]),
            LLAMAMESH_GATEWAY_METRICS_PORT="0",
            LLAMAMESH_GATEWAY_HTTP_PORT="0",
        )  # (the node's gateway has its port)
        wait_until(lambda: serving(f"127.0.0.1:{self.ports[i]}"), 60, f"gateway{i} serving")

    def kill(self, i: int) -> None:
        proc = self.node.procs[f"gateway{i}"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for i in range(2):
            proc = self.node.procs.pop(f"gateway{i}", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def cut_and_resumed(
    gateways: TwoGateways, cuts: list[int], prompt: str | None, **fields: object
) -> list[pb.GenerateResponse]:
    """Read one stream through the client, killing the gateway that carries it after each count of
    messages in ``cuts``; the killed one is started again once the stream flows through the other."""
    got: list[pb.GenerateResponse] = []
    holder, down = 0, None
    async with Client(gateways.target) as client:
        async for m in client.generate(prompt, **fields):
            got.append(m)
            if down is not None:  # the stream flows through the other gateway: the dead one comes back
                await asyncio.to_thread(gateways.start, down)
                down = None
            if cuts and len(got) == cuts[0]:
                cuts.pop(0)
                await asyncio.to_thread(gateways.kill, holder)
                holder, down = 1 - holder, holder
    assert not cuts, f"the stream ended after {len(got)} messages, before every cut"
    return got


def check_whole(got: list[pb.GenerateResponse], ref: list[pb.GenerateResponse], n: int) -> None:
    assert by_sample(got, n) == by_sample(ref, n)
    for k in range(n):
        ids = [t for m in got if m.sample == k for t in m.token_ids]
        assert ids == [t for m in ref if m.sample == k for t in m.token_ids]
        at = 0
        for m in (m for m in got if m.sample == k and m.token_ids):
            assert m.index == at, (k, m.index, at)
            at += len(m.token_ids)
        assert sum(1 for m in got if m.sample == k and m.finish_reason) == 1
    assert got[-1].usage.completion_tokens == ref[-1].usage.completion_tokens


def random_cuts(rng: random.Random, count: int, within: int) -> list[int]:
    """``count`` message counts in [2, within], at least two apart (the killed gateway comes back
    in between)."""
    cuts: list[int] = []
    while len(cuts) < count:
        c = rng.randint(2, within)
        if all(abs(c - x) >= 2 for x in cuts):
            cuts.append(c)
    return sorted(cuts)


@pytest.fixture
def fake_node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    env = {"LLAMAMESH_WORKER_FAKE_STEP_S": "0.02", "LLAMAMESH_WORKER_MAX_INFLIGHT": "16"}
    n = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env=env)
    try:
        n.start(timeout_s=60)
        yield n
    finally:
        n.stop()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_streams_cut_at_random_points_on_the_fake_engine(fake_node: ProcessNode, seed: int) -> None:
    rng = random.Random(seed)
    n = 2 if seed == 2 else 1
    fields = {"max_tokens": 150, "temperature": 0.8, "seed": seed, "n": n}
    cuts = random_cuts(rng, 3, 40)
    print(f"seed {seed}: n={n}, cuts after messages {cuts}")
    async with Client(fake_node.address) as direct:
        ref = [m async for m in direct.generate(f"resume {seed}", **fields)]
    gateways = TwoGateways(fake_node)
    try:
        got = await cut_and_resumed(gateways, cuts, f"resume {seed}", **fields)
    finally:
        gateways.stop()
    check_whole(got, ref, n)


async def test_a_stream_of_the_real_model_cut_twice_reads_as_one(node: ProcessNode) -> None:
    fields = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    messages = [("user", "Tell me about the sea, the sky and the ships.")]
    async with Client(node.address) as direct:
        ref = [m async for m in direct.generate(messages=messages, **fields)]
    assert "".join(m.text for m in ref)
    cuts = random_cuts(random.Random(7), 2, 30)
    gateways = TwoGateways(node)
    try:
        got = await cut_and_resumed(gateways, cuts, None, messages=messages, **fields)
    finally:
        gateways.stop()
    check_whole(got, ref, 1)
