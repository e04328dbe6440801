"""A worker killed (`kill -9`) under a request that no gateway follows at that moment: the worker that
reclaims its job carries it on in place, and the caller's Attach gets exactly the rest of the same
generation, with the real gateway and worker processes on real Redis (the fake engine, whose token
at each position is fixed, so an uninterrupted run is the reference)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llamamesh.queue import codec
from llamamesh.queue.keys import EVENT_FIELD
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.chaos.test_chaos import FAST, events_of, started
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess, free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMPT = "carry me on"
TOKENS = 120


@pytest.fixture
def node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    """A gateway and two workers (claim idle 2 s, a drain's grace 1 s)."""
    with started(e2e_redis, tmp_path, {**FAST, "LLAMAMESH_WORKER_GRACE_S": "1"}) as n:
        n.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
        wait_until(lambda: '"worker_started"' in n.log("worker2"), 30, "the second worker")
        yield n


def worker_of(node: ProcessNode, request_id: str) -> str:
    """The process (its name in ``node.procs``) whose worker published the request's last event."""
    last = codec.decode_event(events_of(node, request_id)[-1][1][EVENT_FIELD.encode()])
    return {"e2e-worker": "worker", "e2e-worker-2": "worker2"}[last.worker]


def ended(node: ProcessNode, request_id: str) -> bool:
    evs = events_of(node, request_id)
    return bool(evs) and codec.decode_event(evs[-1][1][EVENT_FIELD.encode()]).terminal


async def reference(stub: pb_grpc.GenerationServiceStub) -> tuple[list[int], str]:
    whole = [m async for m in stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True))]
    return [t for m in whole for t in m.token_ids], "".join(m.text for m in whole)


async def first_tokens(stub: pb_grpc.GenerationServiceStub, request_id: str, count: int) -> tuple[list[int], str]:
    """A resumable request started and read until ``count`` tokens; then its caller leaves."""
    call = stub.Generate(
        pb.GenerateRequest(request_id=request_id, prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, resumable=True)
    )
    got: list[int] = []
    text = ""
    while len(got) < count:
        m = await call.read()
        got += m.token_ids
        text += m.text
    call.cancel()
    return got, text


async def rest_of(stub: pb_grpc.GenerationServiceStub, request_id: str, offset: int) -> tuple[list[int], str]:
    """Attach from ``offset``: the tokens and text after it, checked contiguous and ending LENGTH once."""
    rest: list[int] = []
    text = ""
    indexes: list[int] = []
    finishes = []
    async for m in stub.Attach(pb.AttachRequest(request_id=request_id, offset=offset)):
        rest += m.token_ids
        text += m.text
        indexes += range(m.index, m.index + len(m.token_ids))
        if m.finish_reason:
            finishes.append(m.finish_reason)
    assert indexes == list(range(offset, TOKENS)) and finishes == [pb.FINISH_REASON_LENGTH]
    return rest, text


@pytest.mark.parametrize(
    ("how", "says"), [(signal.SIGKILL, "killed"), (signal.SIGTERM, "handed back"), (signal.SIGUSR1, "engine died")]
)
async def test_a_detached_request_whose_worker_leaves_is_carried_on_by_the_other(
    node: ProcessNode, how: signal.Signals, says: str
) -> None:
    """Its caller left a resumable request, so no gateway follows it when its worker is killed,
    drained (SIGTERM) with too short a grace (1 s) for the rest, or loses its engine (SIGUSR1 kills
    the fake engine, not the process): the other worker claims the job (claim idle 2 s) and carries
    it on where its stream stood."""
    rid = f"orphan-{how.name}"
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        uninterrupted = asyncio.create_task(reference(stub))  # meanwhile, on the same fake clock
        got, text = await first_tokens(stub, rid, 10)
        victim = worker_of(node, rid)
        node.procs[victim].send_signal(how)
        code = await asyncio.to_thread(node.procs[victim].wait, 30)
        if says == "handed back":
            assert code == 0 and '"job_handed_back"' in node.log(victim)
        if says == "engine died":
            assert code == 1 and '"job_handed_back"' in node.log(victim), node.log(victim)[-3000:]
        await asyncio.to_thread(wait_until, lambda: ended(node, rid), 60, "the request carried on to its end")
        assert '"job_carried_on"' in node.log("worker2" if victim == "worker" else "worker")
        rest, rest_text = await rest_of(stub, rid, len(got))
        ref, ref_text = await uninterrupted
    assert got + rest == ref and text + rest_text == ref_text


async def test_an_attach_whose_gateway_and_then_worker_died_waits_for_the_carried_on_rest(node: ProcessNode) -> None:
    """The gateway that accepted the request is killed, its caller re-attaches through another, and
    then the worker running it is killed too: the Attach waits (GATEWAY_LOST_WORKER_WAIT_S) while
    the other worker reclaims it, and delivers the rest without the caller doing anything."""
    port_b = free_port()
    node.spawn("gateway_b", "services", LLAMAMESH_GATEWAY_PORT=str(port_b))
    await asyncio.to_thread(wait_until, lambda: '"gateway_started"' in node.log("gateway_b"), 30, "gateway b")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port_b}") as ch_b:
        stub_b = pb_grpc.GenerationServiceStub(ch_b)
        uninterrupted = asyncio.create_task(reference(stub_b))  # meanwhile, on the same fake clock
        async with grpc.aio.insecure_channel(node.address) as ch_a:
            got, text = await first_tokens(pb_grpc.GenerationServiceStub(ch_a), "twice", 10)
            node.procs["gateway"].send_signal(signal.SIGKILL)
            node.procs["gateway"].wait(10)
        reading = asyncio.create_task(rest_of(stub_b, "twice", len(got)))
        victim = worker_of(node, "twice")
        node.procs[victim].send_signal(signal.SIGKILL)
        node.procs[victim].wait(10)
        rest, rest_text = await asyncio.wait_for(reading, 90)
        ref, ref_text = await uninterrupted
    assert got + rest == ref and text + rest_text == ref_text
