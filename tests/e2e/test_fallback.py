"""Circuit breaking and fallback between two backend pools, with real processes: the gateway,
redis-server, one fake-engine worker per pool (the engine is not what is under test), and
``kill -9`` as the fault."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llamamesh.client import Client
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode
from tests.e2e.test_node import run_grpcurl
from tests.redisproc import RedisProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SERVING, NOT_SERVING = 1, 2
PRIMARY, BACKUP = "llamamesh.backend.primary", "llamamesh.backend.backup"
FAST = {
    # heartbeats every 0.2 s, dead after 0.8 s; probes every 0.3 s; three failures open it
    "LLAMAMESH_WORKER_HEARTBEAT_S": "0.2",
    "LLAMAMESH_WORKER_HEARTBEAT_TTL_S": "0.8",
    "LLAMAMESH_BREAKER_PROBE_INTERVAL_S": "0.3",
    "LLAMAMESH_BREAKER_PROBE_TIMEOUT_S": "2",
    "LLAMAMESH_BREAKER_OPEN_S": "1",
    "LLAMAMESH_WORKER_FAKE_STEP_S": "0.01",
}


@pytest.fixture
def node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    n = ProcessNode(
        tmp_path,
        e2e_redis,
        engine="fake",
        pool="primary",
        extra_env={**FAST, "LLAMAMESH_GATEWAY_MODELS": "m=primary", "LLAMAMESH_GATEWAY_FALLBACK": "primary=backup"},
    )
    try:
        n.start(timeout_s=60)
        n.spawn("backup", "workers", LLAMAMESH_WORKER_POOL="backup", LLAMAMESH_WORKER_CONSUMER="backup-worker")
        # Both pools serving before the test: on a busy machine the backup worker may start after
        # its pool's first probes (its breaker opens for want of a worker, then closes).
        n._wait(lambda: n._serving(BACKUP), time.monotonic() + 60, "pool backup to be SERVING")
        yield n
    finally:
        n.stop()


async def wait_for(check, timeout_s: float, what: str) -> float:
    """Poll an async check until it holds; returns the seconds it took."""
    t0 = time.monotonic()
    while not await check():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)  # polling another process's state, bounded by timeout_s
    return time.monotonic() - t0


def transitions(node: ProcessNode) -> list[tuple[str, str, str]]:
    out = []
    for line in node.log("gateway").splitlines():
        if '"breaker_transition"' in line:
            x = json.loads(line)
            out.append((x["pool"], x["old"], x["new"]))
    return out


async def generate_ok(c: Client, i: int) -> str:
    msgs = [m async for m in c.generate(prompt=f"req {i}", max_tokens=8, seed=i)]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return "".join(m.text for m in msgs)


async def test_kill_primary_falls_back_without_errors_then_recovers(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        await wait_for(lambda: _is(c, BACKUP, SERVING), 20, "the backup pool to be SERVING")
        assert await c.health(PRIMARY) == SERVING

        # steady traffic throughout: (start time, None or the gRPC error) per request
        stop = asyncio.Event()
        served: list[tuple[float, grpc.aio.AioRpcError | None]] = []

        async def traffic() -> None:
            i = 0
            while not stop.is_set():
                t = time.monotonic()
                try:
                    await generate_ok(c, i)
                    served.append((t, None))
                except grpc.aio.AioRpcError as exc:
                    served.append((t, exc))
                i += 1

        load = asyncio.create_task(traffic())
        await wait_for(lambda: _true(len(served) >= 5), 20, "traffic before the kill")
        node.procs["worker"].send_signal(signal.SIGKILL)
        node.procs["worker"].wait(10)
        t_kill = time.monotonic()
        await wait_for(lambda: _is(c, PRIMARY, NOT_SERVING), 10, "the primary to be NOT_SERVING")
        await wait_for(lambda: _true(("primary", "closed", "open") in transitions(node)), 10, "the breaker to open")
        opened_after = time.monotonic() - t_kill
        before = len(served)
        await wait_for(lambda: _true(len(served) >= before + 10), 20, "traffic on the fallback")
        stop.set()
        await asyncio.wait_for(load, 30)
        # Every request that started after the kill was served (by the fallback), none failed.
        after = [e for t, e in served if t > t_kill]
        assert len(after) >= 10 and all(e is None for e in after), after
        # The one in flight at the kill (tokens already sent, or not) moved on to the fallback too.
        assert [e for _t, e in served if e is not None] == []
        # heartbeat TTL (0.8 s) + three probe intervals (0.9 s) + scheduling slack
        assert opened_after < 4.0, opened_after
        fallback_lines = [x for x in node.log("gateway").splitlines() if '"request_fallback"' in x]
        assert fallback_lines

        # the primary comes back: it opened for want of a worker (nothing a worker did failed), so
        # a worker starting closes it (the pool is coming up: requests wait, not refused), and once
        # that worker is ready the pool serves again
        node.spawn("worker2", "workers")
        closed = ("primary", "open", "closed")
        await wait_for(lambda: _true(closed in transitions(node)), 20, "the breaker to close")
        await wait_for(lambda: _is(c, PRIMARY, SERVING), 20, "the primary to serve again")
        await generate_ok(c, 999)


async def test_a_flood_of_invalid_requests_never_opens_a_breaker(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        await wait_for(lambda: _is(c, PRIMARY, SERVING), 20, "the primary pool to be SERVING")
        before = len(transitions(node))  # (none but a pool's at start, before its worker came)
        bad = [
            pb.GenerateRequest(prompt="x", top_p=3),  # rejected by the gateway
            pb.GenerateRequest(prompt="x", stop_token_ids=[10_000_000]),  # rejected by the engine
            pb.GenerateRequest(prompt="x", model="nope"),  # unknown model
        ]
        for i in range(60):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                [m async for m in c.stub.Generate(bad[i % len(bad)])]
            assert ei.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        # cancellations do not count either
        for i in range(12):
            call = c.stub.Generate(pb.GenerateRequest(prompt=f"c{i}", max_tokens=200, ignore_eos=True))
            async for _m in call:
                break
            call.cancel()
        await generate_ok(c, 1)
        assert await c.health(PRIMARY) == SERVING
    assert transitions(node)[before:] == []


def list_backends(node: ProcessNode) -> dict[str, dict]:
    out = run_grpcurl(node.address, "llamamesh.v1.AdminService/ListBackends")
    assert out.returncode == 0, out.stderr
    return {b["pool"]: b for b in json.loads(out.stdout)["backends"]}


def test_grpcurl_shows_each_pools_health_and_breaker(node: ProcessNode) -> None:
    deadline = time.monotonic() + 20
    while True:
        out = run_grpcurl("-d", json.dumps({"service": BACKUP}), node.address, "grpc.health.v1.Health/Check")
        if out.returncode == 0 and json.loads(out.stdout)["status"] == "SERVING":
            break
        assert time.monotonic() < deadline, out.stdout + out.stderr
        time.sleep(0.1)  # polling the gateway, bounded by the deadline
    for service in (PRIMARY, "llamamesh.liveness", ""):
        out = run_grpcurl("-d", json.dumps({"service": service}), node.address, "grpc.health.v1.Health/Check")
        assert json.loads(out.stdout)["status"] == "SERVING", (service, out.stdout, out.stderr)
    node.procs["worker"].send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while json.loads(run_grpcurl("-d", json.dumps({"service": PRIMARY}), node.address,
                                 "grpc.health.v1.Health/Check").stdout)["status"] != "NOT_SERVING":  # fmt: skip
        assert time.monotonic() < deadline
        time.sleep(0.1)  # polling the gateway, bounded by the deadline
    # the admin RPC shows why: the breaker's state and transition, and who is alive where
    while (backends := list_backends(node))["primary"]["breaker_state"] != "open":
        assert time.monotonic() < deadline, backends
        time.sleep(0.1)  # polling the gateway, bounded by the deadline
    primary, backup = backends["primary"], backends["backup"]
    assert primary["fallback"] == "backup" and not primary.get("workers") and not primary.get("serving")
    (t,) = primary["transitions"]
    assert (t["from_state"], t["to_state"]) == ("closed", "open") and "no live worker" in t["reason"]
    assert backup["breaker_state"] == "closed" and backup["serving"]
    assert [w["name"] for w in backup["workers"]] == ["backup-worker"]


async def _is(c: Client, service: str, state: int) -> bool:
    return await c.health(service) == state


async def _true(value: bool) -> bool:
    return value
