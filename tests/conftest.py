from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from tests.redisproc import RedisProcess


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
    signal method may never get to run."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        marker = item.get_closest_marker("timeout")
        seconds = default
        if marker is not None:
            seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout", default)
        item.add_marker(pytest.mark.timeout(seconds, method="thread"))
