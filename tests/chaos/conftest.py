"""The chaos suite reuses the e2e fixtures (a redis-server per session, process nodes)."""

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import e2e_redis  # noqa: F401
from tests.redisproc import RedisProcess


@pytest.fixture
def own_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisProcess]:
    """A server of this test's own (the test stops it), with AOF, fsync'd on every write unless
    the test asks for another policy."""
    kind = "redis" if shutil.which("redis-server") else "valkey"
    policy = getattr(request, "param", "always")  # "none": no persistence, a restart comes back empty
    fsync = policy.replace("none", "no")
    server = RedisProcess(kind, tmp_path / "redis", appendonly=policy != "none", appendfsync=fsync)
    server.start()
    yield server
    server.stop()
