"""A Redis at its maxmemory (noeviction) refuses writes while it answers reads: the queue says so
(QueueOutOfMemory), and a batch refused half-way is stored whole or not at all; a Redis that would evict
keys instead is named by its policy."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from llamamesh.errors import QueueOutOfMemory
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import BatchState, ItemResult, ItemStatus
from tests.queue.jobs import batch, req
from tests.redisproc import RedisProcess

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.fixture(params=["redis", "valkey"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisProcess]:
    """A server of its own: the test changes its maxmemory."""
    s = RedisProcess(request.param, tmp_path)
    s.start()
    yield s
    s.stop()


@pytest.fixture
async def queue(server: RedisProcess) -> AsyncIterator[RedisQueue]:
    q = RedisQueue.from_settings(RedisSettings(url=server.url, prefix="full"))
    yield q
    await q.close()


async def fill_to(q: RedisQueue, headroom: int) -> None:
    """Redis full once ``headroom`` more bytes are used."""
    used = int((await q.client.info("memory"))["used_memory"])
    await q.client.config_set("maxmemory-policy", "noeviction")
    await q.client.config_set("maxmemory", used + headroom)


async def xadds(q: RedisQueue) -> tuple[int, int]:
    """(XADDs the server ran, XADDs it refused)."""
    stats: Any = await q.client.info("commandstats")
    x = stats.get("cmdstat_xadd", {})
    return int(x.get("calls", 0)), int(x.get("rejected_calls", 0))


async def test_a_full_redis_refuses_writes_as_out_of_memory_and_answers_reads(queue: RedisQueue) -> None:
    epoch = await queue.epoch()
    await fill_to(queue, 0)
    with pytest.raises(QueueOutOfMemory, match="Redis is full"):
        await queue.check_writes()
    with pytest.raises(QueueOutOfMemory) as refused:
        await queue.submit("cpu", req("r1"))
    assert refused.value.retry_after_s > 0
    assert await queue.epoch() == epoch  # reads (the health check's) still answer
    await queue.client.config_set("maxmemory", 0)
    await queue.check_writes()
    await queue.submit("cpu", req("r1"))


async def test_a_batch_refused_half_way_by_a_full_redis_leaves_nothing_and_its_retry_runs_each_item_once(
    queue: RedisQueue,
) -> None:
    store = RedisBatches(queue.client, queue.keys, retention_s=600)
    await store.join("cpu")
    warm, warm_items = batch("warm", 2)
    await store.create(warm, "fp", warm_items)  # (its scripts loaded and the batch sets made first)
    info, items = batch("b", 400)
    items = [(pool, dataclasses.replace(r, prompt="x" * 1000)) for pool, r in items]  # about 1 kB an entry
    await fill_to(queue, 200_000)
    with pytest.raises(QueueOutOfMemory):
        await store.create(info, "fp", items)
    ran, refused = await xadds(queue)
    assert ran > refused > 0, (ran, refused)  # some items were queued before Redis refused the rest
    # Nothing is left: no record, not on its owner's list, none of its items queued.
    assert await store.get("b") is None and [b.batch_id for b in await store.owned("t", 10, None)] == ["warm"]
    assert await queue.client.xlen(queue.keys.batch_lane("cpu", "warm")) == 2  # the warm-up's
    assert not await queue.client.exists(queue.keys.batch_lane("cpu", "b"))

    await queue.client.config_set("maxmemory", 0)  # the operator gave Redis room; the caller retries
    assert {x.request.batch_id for x in await store.lease_items("cpu", "w", 500, None)} == {"warm"}
    got, new = await store.create(info, "fp", items)
    assert new and got.total == 400 and got.state is BatchState.IN_PROGRESS
    seen: list[str] = []
    while leases := await store.lease_items("cpu", "w", 100, None):
        for lease in leases:
            seen.append(lease.request.custom_id)
            await store.record(lease, ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "ok"))
    assert sorted(seen) == sorted(f"c{i}" for i in range(400))  # every item queued once
    done = await store.get("b")
    assert done is not None and done.state is BatchState.COMPLETED and done.succeeded == 400
    results = [r.custom_id for _c, r in await store.results("b", "0-0", None)]  # (one page: 500)
    assert sorted(results) == sorted(f"c{i}" for i in range(400))  # one result each


async def test_a_batch_refused_before_its_record_stores_nothing(queue: RedisQueue) -> None:
    store = RedisBatches(queue.client, queue.keys, retention_s=600)
    await store.join("cpu")
    info, items = batch("early", 3)
    await fill_to(queue, 0)
    with pytest.raises(QueueOutOfMemory):
        await store.create(info, "fp", items)
    await queue.client.config_set("maxmemory", 0)
    assert await store.get("early") is None
    assert not await queue.client.exists(queue.keys.batch_lane("cpu", "early"))


async def test_the_queue_names_a_policy_that_would_evict_its_keys(queue: RedisQueue) -> None:
    assert await queue.eviction() == ""  # no maxmemory: nothing is ever evicted
    await queue.client.config_set("maxmemory", "100mb")
    try:
        assert await queue.eviction() == ""  # noeviction, the servers' default
        for policy in ("volatile-lru", "allkeys-lfu"):
            await queue.client.config_set("maxmemory-policy", policy)
            assert await queue.eviction() == policy
    finally:
        await queue.client.config_set("maxmemory-policy", "noeviction")
        await queue.client.config_set("maxmemory", "0")
