"""The worker's HTTP health endpoint (workers/health.py): /livez and /readyz from a probe, answered
by a thread of its own; the supervisor's probe reads its children's heartbeats from real Redis."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest

from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings, Settings, WorkerSettings
from llamamesh.types import WorkerState, WorkerStatus
from workers.health import HealthServer, Probe, heartbeats_probe

pytestmark = pytest.mark.timeout(30)


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of ``GET path`` on the local ``port``; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # no process listens (it is gone)
        return 0, str(exc)


def test_livez_and_readyz_follow_the_probe() -> None:
    state = {"alive": True, "ready": False, "what": "starting"}
    server = HealthServer(0, "127.0.0.1", lambda: (state["alive"], state["ready"], state["what"])).start()
    try:
        assert get(server.port, "/livez") == (200, "starting\n")
        assert get(server.port, "/readyz") == (503, "starting\n")
        state.update(ready=True, what="ready")
        assert get(server.port, "/readyz") == (200, "ready\n")
        state.update(alive=False, ready=False, what="failed: the engine died")
        assert get(server.port, "/livez")[0] == 503 and get(server.port, "/readyz")[0] == 503
        assert get(server.port, "/metrics")[0] == 404
    finally:
        server.close()


@pytest.mark.redis
async def test_a_supervisor_is_ready_when_every_child_says_ready(redis_settings: RedisSettings) -> None:
    settings = Settings(redis=redis_settings, worker=WorkerSettings(pool="gpu"))
    queue = RedisQueue.from_settings(redis_settings)
    names = ["w-0", "w-1"]
    probe = heartbeats_probe(settings, names)
    try:
        assert await _in_thread(probe) == (True, False, "0/2 workers ready (w-0 absent, w-1 absent)")
        await queue.heartbeat(WorkerStatus(worker="w-0", pool="gpu", state=WorkerState.READY.value), ttl_s=30)
        await queue.heartbeat(WorkerStatus(worker="w-1", pool="gpu", state=WorkerState.STARTING.value), ttl_s=30)
        alive, ready, what = await _in_thread(probe)
        assert (alive, ready) == (True, False) and "w-1 starting" in what
        await queue.heartbeat(WorkerStatus(worker="w-1", pool="gpu", state=WorkerState.READY.value), ttl_s=30)
        assert await _in_thread(probe) == (True, True, "2/2 workers ready")
    finally:
        await queue.close()


async def _in_thread(probe: Probe) -> tuple[bool, bool, str]:
    return await asyncio.to_thread(probe)  # it runs an event loop of its own, as in the server's thread
