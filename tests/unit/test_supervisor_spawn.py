"""The supervisor's real spawn (llamamesh/supervisor.py ``_popen``): a child starts cleanly while gRPC's
threads are busy in the parent, and a supervisor killed with kill -9 leaves no child behind."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llamamesh.supervisor import Child, _popen
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


async def test_children_start_cleanly_while_grpc_threads_are_busy() -> None:
    """A Python ``preexec_fn`` (the old way to ask for the parent-death signal) forked with gRPC's
    threads mid-call; about one child in seven then died of SIGSEGV or SIGABRT before exec, which
    CI saw as a node worker failing to start (exit code -6)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def load() -> None:
            while not stop.is_set():
                await stub.Check(health_pb2.HealthCheckRequest())

        tasks = [asyncio.create_task(load()) for _ in range(8)]
        codes: list[int] = []
        try:
            for _ in range(100):
                proc = _popen(Child("c", (sys.executable, "-S", "-c", "pass"), {}), None)
                assert isinstance(proc, subprocess.Popen)
                codes.append(await asyncio.to_thread(proc.wait, 30))
        finally:
            stop.set()
            await asyncio.gather(*tasks)
            await server.stop(None)
    assert codes == [0] * 100, {c: codes.count(c) for c in set(codes)}


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_gets_sigterm_when_its_supervisor_is_killed(tmp_path: Path) -> None:
    pid_file, term_file = tmp_path / "child.pid", tmp_path / "child.term"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (open({str(term_file)!r}, "w").close(), sys.exit(0)))
        open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
        os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        time.sleep(120)
    """)
    parent = textwrap.dedent(f"""
        import sys
        from llamamesh.supervisor import Child, Supervisor
        sup = Supervisor([Child("c", (sys.executable, "-c", {child!r}), {{}})])
        sup.start()
        sup.run()
    """)
    sup = subprocess.Popen([sys.executable, "-c", parent], cwd=Path(__file__).parents[2])
    try:

        def child_started() -> bool:
            assert sup.poll() is None, "the supervisor exited"
            return pid_file.exists()

        wait_until(child_started, 30, "the child to start")
        pid = int(pid_file.read_text())
        # The child is the real command, exec'd in place of the guard: same pid, its own command line.
        assert "time.sleep(120)" in Path(f"/proc/{pid}/cmdline").read_text()
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
        wait_until(lambda: not _alive(pid), 10, "the child to end after its supervisor's kill -9")
        assert term_file.exists(), "the child ended without its SIGTERM"
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
