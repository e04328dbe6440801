"""The batch store contract, on Redis and Valkey (RedisBatches) and in memory (MemoryBatches)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from llamamesh.errors import InvalidRequest
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.memory import MemoryBatches
from llamamesh.queue.protocol import BatchStore
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


@pytest.fixture(params=["redis", "memory"])
async def store(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[BatchStore]:
    if request.param == "memory":
        yield MemoryBatches()
        return
    q = RedisQueue.from_settings(redis_settings)
    yield RedisBatches(q.client, q.keys, retention_s=60)
    await q.close()


def batch(bid: str, n: int, window_s: float = 3600) -> tuple[BatchInfo, list[tuple[str, GenerationRequest]]]:
    now = time.time()
    info = BatchInfo(batch_id=bid, state=BatchState.VALIDATING, owner="t", model="m", total=n,
                     completion_window_s=int(window_s), created_at=now, expires_at=now + window_s)  # fmt: skip
    items = [("cpu", GenerationRequest(request_id=f"b:{bid}:{i}", model="m", prompt="p", batch_id=bid,
                                       custom_id=f"c{i}")) for i in range(n)]  # fmt: skip
    return info, items


def ok(cid: str) -> ItemResult:
    return ItemResult(cid, ItemStatus.SUCCEEDED, "text")


async def test_submit_is_idempotent_and_atomic(store: BatchStore) -> None:
    info, items = batch("b", 3)
    await store.join("cpu")
    made = await asyncio.gather(*(store.create(info, "fp", items) for _ in range(4)))  # concurrent retries
    assert [new for _b, new in made].count(True) == 1
    assert {b.batch_id for b, _new in made} == {"b"} and made[0][0].state is BatchState.IN_PROGRESS
    with pytest.raises(InvalidRequest) as exc:
        await store.create(info, "another", items)
    assert exc.value.violations[0].field == "batch_id"
    assert [b.batch_id for b in await store.owned("t", 10, None)] == ["b"]
    assert await store.owned("someone-else", 10, None) == []


async def test_one_result_per_custom_id_and_the_last_one_ends_the_batch(store: BatchStore) -> None:
    info, items = batch("r", 2)
    await store.join("cpu")
    await store.create(info, "fp", items)
    leases = await store.lease_items("cpu", "w", 10, 100)
    assert sorted(x.request.custom_id for x in leases) == ["c0", "c1"]
    assert await store.record(leases[0], ok(leases[0].request.custom_id)) is True
    assert await store.record(leases[0], ok(leases[0].request.custom_id)) is False  # a second run: dropped
    mid = await store.get("r")
    assert mid is not None and mid.succeeded == 1 and mid.processing == 1 and mid.state is BatchState.IN_PROGRESS
    await store.record(leases[1], ItemResult(leases[1].request.custom_id, ItemStatus.ERRORED, error_code="x"))
    end = await store.get("r")
    assert end is not None and end.state is BatchState.COMPLETED and (end.succeeded, end.errored) == (1, 1)
    assert {"in_progress", "finalizing", "completed"} <= set(end.times)
    got = await store.results("r", "0-0", None)
    assert [r.custom_id for _c, r in got] == [leases[0].request.custom_id, leases[1].request.custom_id]
    assert [r.custom_id for _c, r in await store.results("r", got[0][0], None)] == [leases[1].request.custom_id]


async def test_cancelled_and_expired_items_come_flagged(store: BatchStore) -> None:
    await store.join("cpu")
    info, items = batch("x", 2)
    await store.create(info, "fp", items)
    cancelled = await store.cancel("x")
    assert cancelled is not None and cancelled.state is BatchState.CANCELLING
    late_info, late_items = batch("late", 1, window_s=-1)  # its window is already over
    await store.create(late_info, "fp", late_items)
    leases = await store.lease_items("cpu", "w", 10, 100)
    flags = {x.request.custom_id + "@" + x.request.batch_id: (x.cancelled, x.expired) for x in leases}
    assert flags == {"c0@x": (True, False), "c1@x": (True, False), "c0@late": (False, True)}
    for x in leases:
        status = ItemStatus.CANCELLED if x.cancelled else ItemStatus.EXPIRED
        await store.record(x, ItemResult(x.request.custom_id, status))
    assert (await store.get("x")).state is BatchState.CANCELLED  # type: ignore[union-attr]
    assert (await store.get("late")).state is BatchState.EXPIRED  # type: ignore[union-attr]
    assert await store.cancel("nope") is None
