"""`llamamesh serve` as a user runs it: the embedded Valkey, the gateway and a CPU worker with the real
model, under the node's supervisor. A request with a temperature of 1e-40 is answered (greedy) and the
node goes on serving; a worker killed with kill -9 is started again and serves within 30 s while the
node keeps running; SIGTERM stops everything cleanly. And a node that cannot start says why, at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from llamamesh.client import Client
from llamamesh.v1 import admin_pb2
from tests.e2e.test_gateway_processes import gone
from tests.redisproc import free_port
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLI = Path(sys.executable).parent / "llamamesh"
HI = [("user", "Hi")]


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMAMESH_")}
    return {
        **env,
        "LLAMAMESH_WORKER_THREADS": "1",
        "LLAMAMESH_REDIS_EMBEDDED_DIR": str(tmp_path / "valkey"),
        "LLAMAMESH_LOG_FORMAT": "json",
        **extra,
    }


@dataclass
class Served:
    proc: subprocess.Popen[str]
    address: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def workers_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "python.* -m workers"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serve_node(tmp_path) as s:
        yield s


@contextlib.contextmanager
def serve_node(tmp_path: Path, *flags: str, **env: str) -> Iterator[Served]:
    """`llamamesh serve` ready to answer (its output in ``serve.log``), stopped with SIGTERM after."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(CLI), "serve", "--port", str(port), *flags],
            env=clean_env(tmp_path, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    s = Served(proc, f"127.0.0.1:{port}", log)
    try:
        wait_until(lambda: "llamamesh serving on" in s.text() or proc.poll() is not None, 240, "the node to be ready")
        assert proc.poll() is None, s.text()[-3000:]
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def greedy(c: Client, **fields: object) -> list[int]:
    return [t async for m in c.generate(messages=HI, max_tokens=8, **fields) for t in m.token_ids]


async def test_a_subnormal_temperature_is_answered_greedy_and_the_node_serves_on(served: Served) -> None:
    async with Client(served.address) as c:
        reference = await greedy(c, temperature=0.0)
        assert await greedy(c, temperature=1e-40) == reference and reference
        # the same edge in a penalty while sampling: answered or refused, never a crash
        (odd,) = await asyncio.gather(
            greedy(c, temperature=1.0, repetition_penalty=1e-40, seed=5), return_exceptions=True
        )
        if isinstance(odd, grpc.aio.AioRpcError):
            assert odd.code() is grpc.StatusCode.INVALID_ARGUMENT, odd
        else:
            assert odd
        assert await greedy(c, temperature=0.0) == reference
    assert served.proc.poll() is None and '"child_exited"' not in served.text()


def test_a_node_with_json_logs_writes_nothing_but_json_lines(served: Served) -> None:
    # its own progress too (operations.md: "one JSON object per line unless stderr is a terminal")
    lines = served.text().splitlines()
    events = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert all(isinstance(e, dict) and "event" in e for e in events), lines
    (serving,) = [e for e in events if e["event"] == "node_serving"]
    assert serving["message"].startswith(f"llamamesh serving on {served.address}"), serving
    assert any(e["event"] == "node_status" and e["message"].startswith("ready: 1 worker(s)") for e in events)


async def test_a_killed_worker_is_back_within_30_s_and_the_node_never_stopped(served: Served) -> None:
    (worker,) = workers_of(served.proc.pid)
    async with Client(served.address) as c:
        reference = await greedy(c, temperature=0.0)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()

        async def answers_again() -> bool:
            try:  # waits while the pool has no worker or a starting one; the 15-s timeout bounds a try
                return await asyncio.wait_for(greedy(c, temperature=0.0), 15) == reference
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                return False  # UNAVAILABLE while nobody serves: try again

        try:
            await until(answers_again, 30, "the same answer from a new worker", poll_s=0.5)
        except TimeoutError as exc:
            raise AssertionError(served.text()[-3000:]) from exc
        back = time.monotonic() - t0
        new = workers_of(served.proc.pid)
        assert len(new) == 1 and new != [worker]
        assert served.proc.poll() is None  # the node (gateway, Valkey) never stopped

        async def states() -> list[str]:  # the gateway's view, refreshed every probe interval
            reply = await c.admin.ListBackends(admin_pb2.ListBackendsRequest())
            return [w.state for b in reply.backends if b.pool == "cpu" for w in b.workers]

        await until(states, 5, "the gateway to list one ready worker", done=lambda s: s == ["ready"], poll_s=0.1)
    assert '"child_exited"' in served.text() and '"exit_code": -9' in served.text()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0
    wait_until(lambda: not workers_of(served.proc.pid), 10, "its children gone")
    print(f"worker back and serving {back:.1f} s after kill -9")


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_a_second_sigterm_while_the_node_stops_never_leaves_its_children_behind(tmp_path: Path) -> None:
    """SIGTERM, then SIGTERM again while the gateway settles: the second goes on to the children (the
    gateway skips the rest of its settle wait); the node exits 0 once they all did, the embedded
    Valkey included, never before them."""
    with serve_node(tmp_path, "--engine", "fake") as s:
        children = children_of(s.proc.pid)  # the gateway, the worker, the embedded Valkey
        assert len(children) == 3, children
        s.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: '"gateway_settling"' in s.text(), 20, "the gateway to settle")
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.text()[-3000:]
        assert all(gone(pid) for pid in children), s.text()[-3000:]


async def test_a_request_sent_while_the_node_settles_is_answered(tmp_path: Path) -> None:
    """SIGTERM stops the gateway first: while it settles (still accepting, for a load balancer to
    notice) its workers still run what it accepts, and stop only after it drained."""
    with serve_node(tmp_path, "--engine", "fake") as s:
        s.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_until, lambda: '"gateway_settling"' in s.text(), 20, "the gateway to settle")
        async with Client(s.address) as c:
            answer = await asyncio.wait_for(c.complete("Hi", max_tokens=4), 10)
        assert answer, s.text()[-3000:]
        assert await asyncio.to_thread(s.proc.wait, 60) == 0


def two_free_ports() -> int:
    """A port that is free, and the one after it."""
    while True:
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))
            return port


def test_each_worker_of_a_node_serves_its_health_on_the_setting_plus_its_index(tmp_path: Path) -> None:
    port = two_free_ports()
    env = {"LLAMAMESH_WORKER_ENGINE": "fake", "LLAMAMESH_WORKER_HEALTH_PORT": str(port)}
    with serve_node(tmp_path, "--workers", "2", **env) as served:
        for i in range(2):
            url = f"http://127.0.0.1:{port + i}/readyz"
            with urllib.request.urlopen(url, timeout=5) as reply:
                assert reply.status == 200, url
            assert f"health (worker-{i}): {url}" in served.text()


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_a_node_that_cannot_start_says_why_in_one_line_and_exits_non_zero(tmp_path: Path, command: str) -> None:
    args = [
        str(CLI),
        command,
        *(["hello"] if command == "demo" else []),
        "--model-path",
        str(tmp_path / "no.gguf"),
        "--port",
        str(free_port()),
    ]
    t0 = time.monotonic()
    out = subprocess.run(
        args, env=clean_env(tmp_path, LLAMAMESH_LOG_LEVEL="error"), capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "could not start: cannot load model" in errors[0] and "no.gguf" in errors[0], errors
    assert took < 60, took  # not a timeout: the worker said why


def test_a_gateway_that_cannot_start_stops_the_node_at_once_with_one_error_line(tmp_path: Path) -> None:
    """The gateway's own line names the setting; the node adds no second error, and does not wait for
    a worker still converting its model (a fresh cache) to drain: it never served anything."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http = taken.getsockname()[1]
        args = [str(CLI), "serve", "--port", str(free_port())]
        env = clean_env(
            tmp_path,
            LLAMAMESH_LOG_LEVEL="error",
            LLAMAMESH_LOG_FORMAT="console",
            LLAMAMESH_GATEWAY_HTTP_PORT=str(http),
            LLAMAMESH_WORKER_CACHE_DIR=str(tmp_path / "cache"),
        )
        t0 = time.monotonic()
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert "LLAMAMESH_GATEWAY_HTTP_PORT" in errors[0] and "in use" in errors[0], errors
    assert "the node stops: the node's gateway ended (exit code 1) while starting" in out.stderr
    assert took < 15, took  # the model's conversion alone takes longer


def test_a_node_whose_redis_never_answers_says_so_and_exits(tmp_path: Path) -> None:
    args = [str(CLI), "serve", "--redis-url", f"redis://127.0.0.1:{free_port()}", "--port", str(free_port())]
    t0 = time.monotonic()
    wait_s = 3
    env = clean_env(
        tmp_path, LLAMAMESH_LOG_LEVEL="error", LLAMAMESH_WORKER_ENGINE="fake", LLAMAMESH_REDIS_START_WAIT_S=str(wait_s)
    )
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert "LLAMAMESH_REDIS_URL" in errors[0] and f"did not answer within {wait_s} s" in errors[0], errors
    assert "LLAMAMESH_REDIS_START_WAIT_S" in errors[0], errors
    assert wait_s <= took < wait_s + 30, took
