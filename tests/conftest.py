from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from tests.images import prepare_in_background
from tests.redisproc import RedisProcess

# Where each node log stood when the running test began (bytes), and the most of it a report shows.
_LOG_START = pytest.StashKey[dict[Path, int]]()
REPORT_LOG_LINES = 150


@pytest.fixture(scope="session", params=["redis", "valkey"])
def redis_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A real server of each kind, started by the tests, shared by the session."""
    server = RedisProcess(request.param, tmp_path_factory.mktemp(f"{request.param}-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_settings(redis_server: RedisProcess) -> RedisSettings:
    """Settings with a key prefix unique to the test."""
    return RedisSettings(url=redis_server.url, prefix=f"test:{uuid.uuid4().hex[:10]}", block_ms=200)


@pytest.fixture
async def redis_queue(redis_settings: RedisSettings) -> AsyncIterator[RedisQueue]:
    q = RedisQueue.from_settings(redis_settings)
    yield q
    await q.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests time out by pytest-timeout's thread method: it dumps every stack and ends the run
    even when the test is stuck in C code (an engine start waiting on a child process), where the
    signal method may never get to run. The container tests go last, their images made meanwhile."""
    prepare_in_background(config, items)
    default = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        marker = item.get_closest_marker("timeout")
        seconds = default
        if marker is not None:
            seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout", default)
        item.add_marker(pytest.mark.timeout(seconds, method="thread"))


def _node_logs() -> Iterator[tuple[str, Path, int | None]]:
    """(name, log file, exit status or None while it runs) of every process of every e2e node so far."""
    e2e = sys.modules.get("tests.e2e.conftest")  # not loaded: no e2e test ran, no node was made
    for node in getattr(e2e, "NODES", ()):
        for name, proc in node.procs.items():
            yield name, node.log_path(name), proc.poll()


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_LOG_START] = {path: path.stat().st_size for _n, path, _rc in _node_logs() if path.exists()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failing test's report shows what each gateway and worker process logged during it (the last
    REPORT_LOG_LINES lines) and whether it still runs: e2e and chaos failures that happen once in
    many runs must be readable from that one run's output."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when == "teardown":
        return
    start = item.stash.get(_LOG_START, {})
    for name, path, rc in _node_logs():
        if not path.exists() or path.stat().st_size <= start.get(path, 0):
            continue
        with path.open("rb") as f:
            f.seek(start.get(path, 0))
            lines = f.read().decode(errors="replace").splitlines()[-REPORT_LOG_LINES:]
        state = "running" if rc is None else f"exited {rc}"
        report.sections.append((f"{name} log ({state}, {path})", "\n".join(lines)))
