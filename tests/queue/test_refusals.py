"""A Redis that answers and refuses this client (its password, an ACL permission the queue needs, the database
index) is named as such by the queue's preflight, not taken for one that does not answer; and each process
refused at its start stops with one line saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from llamamesh.errors import QueueRefused, QueueUnavailable
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from tests.redisproc import RedisProcess, free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

CLI = Path(sys.executable).parent / "llamamesh"


@pytest.fixture(scope="module", params=["redis", "valkey"])
def guarded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A server with a password and two users short of what the queue needs."""
    server = RedisProcess(request.param, tmp_path_factory.mktemp(f"{request.param}-acl"))
    server.start()
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "noscript", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    admin.execute_command("ACL", "SETUSER", "noclaim", "on", ">pw", "~*", "&*", "+@all", "-xautoclaim")
    admin.execute_command("ACL", "SETUSER", "default", "on", ">s3cret")
    yield server
    server.stop()


def url(server: RedisProcess, auth: str, db: int = 0) -> str:
    return f"redis://{auth}@127.0.0.1:{server.port}/{db}"


@pytest.mark.parametrize(
    ("auth", "db", "said"),
    [
        (":nope", 0, "invalid username-password"),
        ("noscript:pw", 0, "'eval' command"),
        ("noclaim:pw", 0, "'xautoclaim' command"),
        (":s3cret", 99, "DB index is out of range"),
    ],
)
async def test_the_preflight_names_what_redis_refuses(guarded: RedisProcess, auth: str, db: int, said: str) -> None:
    queue = RedisQueue.from_settings(RedisSettings(url=url(guarded, auth, db), prefix="refusals"))
    try:
        with pytest.raises(QueueRefused) as refused:
            await queue.preflight()
        assert said in refused.value.reason and "Redis refuses this client" in refused.value.reason
        assert refused.value.message == "the queue is unreachable"  # (callers are told no more)
    finally:
        await queue.close()


async def test_the_preflight_passes_a_client_redis_takes_and_waits_out_one_that_does_not_answer(
    guarded: RedisProcess,
) -> None:
    queue = RedisQueue.from_settings(RedisSettings(url=url(guarded, ":s3cret", 3), prefix="refusals"))
    absent = RedisQueue.from_settings(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", prefix="refusals"))
    try:
        await queue.preflight()
        with pytest.raises(QueueUnavailable) as down:
            await absent.preflight()
        assert not isinstance(down.value, QueueRefused)
    finally:
        await queue.close()
        await absent.close()


@pytest.mark.parametrize("command", ["gateway", "worker", "serve"])
def test_a_process_refused_by_redis_at_its_start_stops_with_one_line_naming_why(
    guarded: RedisProcess, command: str, tmp_path: Path
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LLAMAMESH_")},
        "HOME": str(tmp_path),
        "LLAMAMESH_REDIS_URL": url(guarded, "noscript:pw"),
        "LLAMAMESH_REDIS_START_WAIT_S": "60",
        "LLAMAMESH_WORKER_ENGINE": "fake",
        "LLAMAMESH_GATEWAY_PORT": str(free_port()),
        "LLAMAMESH_LOG_LEVEL": "error",
    }
    out = subprocess.run([str(CLI), command], env=env, capture_output=True, text=True, timeout=60)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert "'eval' command" in errors[0] and "LLAMAMESH_REDIS_URL" in errors[0], errors
    assert "pw@" not in out.stderr  # (the password never shown)
