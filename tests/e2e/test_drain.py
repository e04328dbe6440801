"""A rolling restart as a load balancer sees it: two gateway processes on their own ports, one
fake-engine worker, a client spreading calls over both with round_robin (as over a Kubernetes
headless Service) and sending without pause. The first gateway is SIGTERMed: it turns NOT_SERVING,
keeps serving for its settle window while the client's health watch moves calls away, then stops
accepting and drains. Not one call fails."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from llamamesh.client import Client
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess, free_port
from tests.waiting import until, wait_until
from tests.workers.test_health_http import get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SENDERS = 8


def served(node: ProcessNode, name: str) -> int:
    return node.log(name).count('"rpc_finished"')


async def test_a_sigtermed_gateway_fails_no_call_of_a_client_sending_through_both(
    e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    env = {
        "LLAMAMESH_GATEWAY_SETTLE_S": "2",
        "LLAMAMESH_WORKER_MAX_INFLIGHT": "64",
        "LLAMAMESH_WORKER_FAKE_STEP_S": "0.01",
    }
    node = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env=env)
    port2 = free_port()
    try:
        node.start(timeout_s=60)
        node.spawn("gateway2", "services", LLAMAMESH_GATEWAY_PORT=str(port2))
        wait_until(lambda: '"gateway_started"' in node.log("gateway2"), 30, "the second gateway")
        target = f"ipv4:127.0.0.1:{node.port},127.0.0.1:{port2}"
        ok: list[float] = []
        failed: list[str] = []
        stop = asyncio.Event()
        async with Client(target, load_balancing="round_robin") as c:
            await c.wait_ready(30)

            async def sender() -> None:
                while not stop.is_set():
                    try:
                        msgs = [m async for m in c.generate("x", max_tokens=5, ignore_eos=True, timeout=30)]
                        assert msgs[-1].usage.completion_tokens == 5
                        ok.append(time.monotonic())
                    except grpc.aio.AioRpcError as exc:
                        failed.append(f"{exc.code().name}: {exc.details()}")

            senders = [asyncio.create_task(sender()) for _ in range(SENDERS)]
            both = lambda: served(node, "gateway") and served(node, "gateway2") and len(ok) > SENDERS  # noqa: E731
            await until(both, 30, "calls served by both gateways", poll_s=0.1)
            before = served(node, "gateway")
            assert before > 0 and len(ok) > SENDERS, (before, len(ok))
            node.procs["gateway"].send_signal(signal.SIGTERM)
            t_term = time.monotonic()
            code = await asyncio.to_thread(node.procs["gateway"].wait, 30)
            t_exit = time.monotonic()
            await until(lambda: sum(1 for t in ok if t > t_exit) > SENDERS, 30, "calls through the second alone")
            stop.set()
            await asyncio.wait_for(asyncio.gather(*senders), 30)
        assert code == 0
        assert not failed, failed[:5]
        assert '"gateway_settling"' in node.log("gateway")
        # Both processes froze their start-up heap once serving (llamamesh/loop.py: serving_heap),
        # and the gateway accepted with its extra call requests (services/accept.py).
        assert '"heap_frozen"' in node.log("gateway") and '"heap_frozen"' in node.log("worker")
        assert '"acceptors": 8' in node.log("gateway")
        assert t_exit - t_term >= 2.0  # it settled before it stopped accepting
        assert sum(1 for t in ok if t > t_exit) > SENDERS  # the second gateway took them all
        print(
            f"{len(ok)} calls, 0 failed; the first gateway served {served(node, 'gateway')}, "
            f"the second {served(node, 'gateway2')}; SIGTERM to exit {t_exit - t_term:.2f} s"
        )
    finally:
        node.stop()


async def test_a_draining_worker_says_not_ready_and_alive_on_its_health_port(
    e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    """The worker's /readyz is 200 while it leases, 503 once SIGTERM made it drain (its open job
    still finishing), /livez 200 all along; then it exits 0."""
    port = free_port()
    env = {"LLAMAMESH_WORKER_HEALTH_PORT": str(port), "LLAMAMESH_WORKER_FAKE_STEP_S": "0.02"}
    node = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env=env)
    try:
        node.start(timeout_s=60)
        assert get(port, "/readyz")[0] == 200 and get(port, "/livez")[0] == 200
        async with Client(node.address) as c:
            got: list = []
            stream = asyncio.create_task(_collect(c.generate("x", max_tokens=100, ignore_eos=True, timeout=30), got))
            await until(lambda: got, 30, "the first tokens: it runs on the worker")
            node.procs["worker"].send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_until, lambda: get(port, "/readyz")[0] == 503, 10, "readyz 503")
            _status, body = get(port, "/readyz")
            assert "stopping" in body, body
            assert get(port, "/livez")[0] == 200
            msgs = await asyncio.wait_for(stream, 30)
        assert msgs[-1].usage.completion_tokens == 100  # drained, not cut
        assert await asyncio.to_thread(node.procs["worker"].wait, 30) == 0
    finally:
        node.stop()


async def _collect(stream, into: list) -> list:  # type: ignore[no-untyped-def]
    async for m in stream:
        into.append(m)
    return into


def test_a_gateway_sigtermed_as_it_starts_stops_at_once(e2e_redis: RedisProcess, tmp_path: Path) -> None:
    """SIGTERM while the gateway's background loops (the batch sweep, health, stream leases) make
    their first Redis calls: it exits 0 at once, every time (not after a loop's interval, nor killed
    by its supervisor after the grace)."""
    node = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env={"LLAMAMESH_BATCH_SWEEP_INTERVAL_S": "3600"})
    node.spawn("worker", "workers")
    try:
        for attempt in range(6):
            name = f"gateway-{attempt}"
            node.spawn(name, "services")
            wait_until(lambda n=name: '"gateway_started"' in node.log(n), 30, f"{name} started", poll_s=0.005)
            t0 = time.monotonic()
            node.procs[name].send_signal(signal.SIGTERM)
            assert node.procs[name].wait(15) == 0, node.log(name)[-2000:]
            assert time.monotonic() - t0 < 5, node.log(name)[-2000:]
    finally:
        node.stop()
