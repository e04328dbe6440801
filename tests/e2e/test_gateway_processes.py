"""Several gateway processes on one port (LLAMAMESH_GATEWAY_PROCESSES): real processes, real Redis,
the fake engine (what is under test is the gateway's process supervision, not a model)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def children(pid: int) -> list[int]:
    """The gateway processes a supervisor started."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "python.* -m services"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): it is gone once its status says so
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


@pytest.fixture
def node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    n = ProcessNode(
        tmp_path,
        e2e_redis,
        engine="fake",
        extra_env={"LLAMAMESH_GATEWAY_PROCESSES": "3", "LLAMAMESH_WORKER_MAX_INFLIGHT": "64"},
    )
    try:
        n.start(timeout_s=60)
        yield n
    finally:
        n.stop()


async def test_three_gateways_share_the_port_serve_and_stop_cleanly(node: ProcessNode) -> None:
    supervisor = node.procs["gateway"]
    wait_until(lambda: len(children(supervisor.pid)) == 3, 30, "three gateway processes")
    wait_until(lambda: node.log("gateway").count('"gateway_started"') == 3, 30, "every gateway listening")

    # The kernel spreads connections over the processes: channels with connections of their own (not
    # the process-wide subchannel pool, which would share one) reach several of them.
    async def one(i: int) -> str:
        async with grpc.aio.insecure_channel(node.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            msgs = [m async for m in stub.Generate(pb.GenerateRequest(prompt=f"hello {i}", max_tokens=4))]
            return "".join(m.text for m in msgs)

    texts = await asyncio.gather(*(one(i) for i in range(24)))
    assert all(texts)
    # rpc_finished is logged just after a stream's last message: wait for all 24 lines
    wait_until(lambda: node.log("gateway").count('"rpc_finished"') >= 24, 10, "24 rpc_finished lines")
    served = {
        line.split('"process": "')[1].split('"')[0]
        for line in node.log("gateway").splitlines()
        if '"rpc_finished"' in line
    }
    assert len(served) >= 2, served

    kids = children(supervisor.pid)
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    wait_until(lambda: all(gone(k) for k in kids), 10, "the gateway processes to exit")
    assert node.log("gateway").count('"gateway_stopped"') == 3


async def test_a_dead_gateway_process_is_started_again_while_the_others_serve(node: ProcessNode) -> None:
    supervisor = node.procs["gateway"]
    wait_until(lambda: len(children(supervisor.pid)) == 3, 30, "three gateway processes")
    wait_until(lambda: node.log("gateway").count('"gateway_started"') == 3, 30, "every gateway listening")
    kids = children(supervisor.pid)
    os.kill(kids[0], signal.SIGKILL)
    # The port keeps serving meanwhile: a connection the kernel had queued on the dead process's
    # listener is reset (SO_REUSEPORT), so a caller's next connection reaches a live one.
    served, reset = 0, []
    for _ in range(6):
        async with grpc.aio.insecure_channel(node.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            try:
                served += bool([m async for m in stub.Generate(pb.GenerateRequest(prompt="still here", max_tokens=2))])
            except grpc.aio.AioRpcError as err:
                reset.append(err.code())
    assert served >= 3 and set(reset) <= {grpc.StatusCode.UNAVAILABLE}, (served, reset)
    wait_until(
        lambda: (now := children(supervisor.pid)) and len(now) == 3 and kids[0] not in now,
        30,
        "the dead process started again",
    )
    wait_until(lambda: node.log("gateway").count('"gateway_started"') == 4, 30, "the new one listening")
    assert '"child_exited"' in node.log("gateway") and supervisor.poll() is None
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
