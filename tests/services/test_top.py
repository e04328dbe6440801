"""``llamamesh top`` redrawing until Ctrl-C (a real subprocess against the in-process gateway), and the
queue figures ListBackends carries over the in-memory queue."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
import pytest

from llamamesh.v1 import admin_pb2, admin_pb2_grpc
from tests.services.conftest import Stack

pytestmark = pytest.mark.timeout(30)


async def test_top_redraws_until_ctrl_c_and_exits_0(stack: Stack) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llamamesh.cli",
        "top",
        "--interval",
        "0.1",
        "--address",
        f"127.0.0.1:{stack.gateway.port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    titles = 0
    try:
        while titles < 3:  # three frames, one after another
            line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
            assert line, "top ended early"
            titles += line.startswith("llamamesh top ")
        proc.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert b"\x1b[" not in rest  # not a TTY: plain frames, no ANSI redraw
    assert b"Traceback" not in err


async def test_ctrl_c_while_the_gateway_does_not_answer_exits_at_once() -> None:
    """Ctrl-C ends top at once even while its ListBackends waits (10 s) on a gateway that never answers."""
    entered = asyncio.Event()

    class Hung(admin_pb2_grpc.AdminServiceServicer):
        async def ListBackends(self, request: object, context: object) -> admin_pb2.ListBackendsResponse:
            entered.set()
            await asyncio.Event().wait()  # never answers
            return admin_pb2.ListBackendsResponse()

    server = grpc.aio.server()
    admin_pb2_grpc.add_AdminServiceServicer_to_server(Hung(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llamamesh.cli",
        "top",
        "--address",
        f"127.0.0.1:{port}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(entered.wait(), 15)  # its first call is in flight
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 5)  # not the call's 10 s
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(0)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err


async def test_list_backends_carries_queue_depth(stack: Stack) -> None:
    admin = admin_pb2_grpc.AdminServiceStub(stack.channel)
    got = {b.pool: b for b in (await admin.ListBackends(admin_pb2.ListBackendsRequest())).backends}
    cpu = got["cpu"]
    assert cpu.HasField("queue_depth") and cpu.HasField("queue_pending")
    assert (cpu.queue_depth, cpu.queue_pending) == (0, 0)
    stack.queue.down = True  # unknown, not zero
    got = {b.pool: b for b in (await admin.ListBackends(admin_pb2.ListBackendsRequest())).backends}
    assert not got["cpu"].HasField("queue_depth") and not got["cpu"].HasField("queue_pending")
    stack.queue.down = False
