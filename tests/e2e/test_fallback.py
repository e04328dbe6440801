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
from tests.waiting import until, wait_until

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
        await until(lambda: _is(c, BACKUP, SERVING), 20, "the backup pool to be SERVING", poll_s=0.05)
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
        await until(lambda: len(served) >= 5, 20, "traffic before the kill")
        node.procs["worker"].send_signal(signal.SIGKILL)
        node.procs["worker"].wait(10)
        t_kill = time.monotonic()
        await until(lambda: _is(c, PRIMARY, NOT_SERVING), 10, "the primary to be NOT_SERVING", poll_s=0.05)
        opened = ("primary", "closed", "open")
        await until(lambda: opened in transitions(node), 10, "the breaker to open", poll_s=0.05)
        opened_after = time.monotonic() - t_kill
        before = len(served)
        await until(lambda: len(served) >= before + 10, 20, "traffic on the fallback")
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
        await until(lambda: closed in transitions(node), 20, "the breaker to close", poll_s=0.05)
        await until(lambda: _is(c, PRIMARY, SERVING), 20, "the primary to serve again", poll_s=0.05)
        await generate_ok(c, 999)


async def test_a_flood_of_invalid_requests_never_opens_a_breaker(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        await until(lambda: _is(c, PRIMARY, SERVING), 20, "the primary pool to be SERVING", poll_s=0.05)
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
    def health(service: str) -> str:
        """The service's status as grpcurl reads it (what grpcurl said when it failed)."""
        out = run_grpcurl("-d", json.dumps({"service": service}), node.address, "grpc.health.v1.Health/Check")
        return str(json.loads(out.stdout)["status"]) if out.returncode == 0 else out.stdout + out.stderr

    wait_until(lambda: health(BACKUP), 20, "the backup pool SERVING", done=lambda s: s == "SERVING", poll_s=0.1)
    for service in (PRIMARY, "llamamesh.liveness", ""):
        out = run_grpcurl("-d", json.dumps({"service": service}), node.address, "grpc.health.v1.Health/Check")
        assert json.loads(out.stdout)["status"] == "SERVING", (service, out.stdout, out.stderr)
    node.procs["worker"].send_signal(signal.SIGKILL)
    wait_until(lambda: health(PRIMARY), 10, "the primary NOT_SERVING", done=lambda s: s == "NOT_SERVING", poll_s=0.1)
    # the admin RPC shows why: the breaker's state and transition, and who is alive where
    backends = wait_until(
        lambda: list_backends(node),
        10,
        "the primary's breaker open",
        done=lambda got: got["primary"]["breaker_state"] == "open",
        poll_s=0.1,
    )
    primary, backup = backends["primary"], backends["backup"]
    assert primary["fallback"] == "backup" and not primary.get("workers") and not primary.get("serving")
    (t,) = primary["transitions"]
    assert (t["from_state"], t["to_state"]) == ("closed", "open") and "no live worker" in t["reason"]
    assert backup["breaker_state"] == "closed" and backup["serving"]
    assert [w["name"] for w in backup["workers"]] == ["backup-worker"]


async def _is(c: Client, service: str, state: int) -> bool:
    return await c.health(service) == state
