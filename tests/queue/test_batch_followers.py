"""Waiting StreamBatchResults readers share the batch store's one follower: their number does not
show in the Redis connections the store holds. Against real servers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from llamamesh.errors import InvalidRequest
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.protocol import Lease
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult, ItemStatus
from tests.queue.conftest import raw_client
from tests.redisproc import RedisProcess
from tests.waiting import blocked_in, until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

N = 200
# The blocked XREAD, a wake-up write, a short read or two: a constant, not one per waiting reader.
MOST_CONNECTIONS = 4


class Stores:
    """The store under test on a client of its own (named, so its connections can be counted), and
    a second one on another client that plays the workers' side."""

    def __init__(self, reader: RedisBatches, writer: RedisBatches, observer: aioredis.Redis, name: str) -> None:
        self.reader = reader
        self.writer = writer
        self._observer = observer
        self._name = name

    async def connections(self) -> int:
        """The reader client's connections, as the server counts them (CLIENT LIST)."""
        clients = await self._observer.client_list()
        return sum(1 for c in clients if c.get("name") == self._name)

    async def blocked(self) -> int:
        """The reader client's connections blocked in XREAD (on a cluster, where raw_client names
        no client, every client's)."""
        cluster = isinstance(self._observer, aioredis.RedisCluster)
        return await blocked_in(self._observer, "xread", None if cluster else self._name)

    async def batches(self, n: int) -> list[Lease]:
        """``n`` batches of one item each, created and leased on the writer's side."""
        await self.writer.join("cpu")
        now = time.time()
        for i in range(n):
            bid = f"b{i}"
            info = BatchInfo(
                batch_id=bid,
                state=BatchState.VALIDATING,
                owner="t",
                model="m",
                total=1,
                completion_window_s=3600,
                created_at=now,
                expires_at=now + 3600,
            )
            req = GenerationRequest(request_id=f"b:{bid}:0", model="m", prompt="p", batch_id=bid, custom_id=f"{bid}-c")
            await self.writer.create(info, "fp", [("cpu", req)])
        leases = await self.writer.lease_items("cpu", "w", n, 100)
        assert len(leases) == n
        return sorted(leases, key=lambda x: int(x.request.batch_id[1:]))


@pytest.fixture
async def stores(redis_settings: RedisSettings) -> AsyncIterator[Stores]:
    name = f"followers-{uuid.uuid4().hex[:8]}"
    reader_client = raw_client(redis_settings, client_name=name, socket_timeout=30)
    observer = raw_client(redis_settings, socket_timeout=30)
    q = RedisQueue.from_settings(redis_settings)
    reader = RedisBatches(reader_client, q.keys, retention_s=60, follow_block_ms=2000)
    writer = RedisBatches(q.client, q.keys, retention_s=60)
    yield Stores(reader, writer, observer, name)
    await reader.close()
    await reader_client.aclose()
    await observer.aclose()
    await q.close()


def followers(store: RedisBatches) -> int:
    follower = store._follower
    return 0 if follower is None else follower.followers


async def test_many_waiting_readers_hold_a_bounded_number_of_connections(stores: Stores) -> None:
    leases = await stores.batches(N)
    store = stores.reader
    # One reader first, so the shared XREAD is blocked when the others arrive (each must wake it).
    first = asyncio.create_task(store.results("b0", "0-0", 30_000))
    await until(stores.blocked, 10, "the first reader's shared XREAD to block")
    rest = [asyncio.create_task(store.results(f"b{i}", "0-0", 30_000)) for i in range(1, N)]
    tasks = [first, *rest]
    await until(lambda: followers(store) == N, 10, f"{N} followers")
    waiting = await stores.connections()
    assert waiting <= MOST_CONNECTIONS, f"{waiting} connections for {N} waiting readers"
    assert not any(t.done() for t in tasks)

    for lease in leases:  # each reader wakes with its own batch's result
        assert await stores.writer.record(lease, ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "t"))
    got = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert [[r.custom_id for _c, r in one] for one in got] == [[f"b{i}-c"] for i in range(N)]
    assert followers(store) == 0
    assert await stores.connections() <= MOST_CONNECTIONS


async def test_a_reader_after_its_cursor_waits_and_wakes_on_the_next_result(stores: Stores) -> None:
    store = stores.reader
    await stores.writer.join("cpu")
    now = time.time()
    info = BatchInfo(
        batch_id="two",
        state=BatchState.VALIDATING,
        owner="t",
        model="m",
        total=2,
        completion_window_s=3600,
        created_at=now,
        expires_at=now + 3600,
    )
    items = [
        ("cpu", GenerationRequest(request_id=f"b:two:{i}", model="m", prompt="p", batch_id="two", custom_id=f"c{i}"))
        for i in range(2)
    ]
    await stores.writer.create(info, "fp", items)
    leases = await stores.writer.lease_items("cpu", "w", 2, 100)
    await stores.writer.record(leases[0], ItemResult(leases[0].request.custom_id, ItemStatus.SUCCEEDED))
    there = await store.results("two", "0-0", 5000)  # already there: at once, through the follower
    assert [r.custom_id for _c, r in there] == [leases[0].request.custom_id]
    assert await store.results("two", "0-0", None) == there  # the non-blocking read agrees
    t0 = time.monotonic()
    assert await store.results("two", there[0][0], 200) == []  # nothing after it within the block
    assert 0.15 <= time.monotonic() - t0 < 2
    later = asyncio.create_task(store.results("two", there[0][0], 10_000))
    await until(lambda: followers(store) == 1, 10, "one follower")
    await stores.writer.record(leases[1], ItemResult(leases[1].request.custom_id, ItemStatus.SUCCEEDED))
    got = await asyncio.wait_for(later, 5)
    assert [r.custom_id for _c, r in got] == [leases[1].request.custom_id]
    assert followers(store) == 0


async def test_cancelled_readers_leave_no_follower_behind(stores: Stores) -> None:
    store = stores.reader
    tasks = [asyncio.create_task(store.results(f"never{i}", "0-0", 60_000)) for i in range(50)]
    await until(lambda: followers(store) == 50, 10, "50 followers")
    for t in tasks:
        t.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert followers(store) == 0
    assert await stores.connections() <= MOST_CONNECTIONS
    # The follower still serves the next reader.
    leases = await stores.batches(1)
    after = asyncio.create_task(store.results("b0", "0-0", 10_000))
    await until(lambda: followers(store) == 1, 10, "one follower")
    await stores.writer.record(leases[0], ItemResult(leases[0].request.custom_id, ItemStatus.SUCCEEDED))
    assert [r.custom_id for _c, r in await asyncio.wait_for(after, 5)] == ["b0-c"]


async def test_a_cursor_that_is_no_stream_id_is_refused_before_the_shared_read(stores: Stores) -> None:
    store = stores.reader
    ok = asyncio.create_task(store.results("fine", "0-0", 10_000))
    await until(lambda: followers(store) == 1, 10, "one follower")
    for bad in ("99999999999999999999-0", "0-18446744073709551616", "$", "", "1-2-3", "+"):
        for block_ms in (None, 500):
            with pytest.raises(InvalidRequest) as exc:
                await store.results("fine", bad, block_ms)
            assert exc.value.violations[0].field == "cursor"
    assert await store.results("fine", "18446744073709551615-18446744073709551615", None) == []
    assert await store.results("fine", "5", None) == []
    assert not ok.done() and followers(store) == 1  # the waiting reader never saw them
    ok.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ok


async def test_close_stops_the_follower(stores: Stores) -> None:
    store = stores.reader
    waiting = asyncio.create_task(store.results("x", "0-0", 300))
    await until(lambda: followers(store) == 1, 10, "one follower")
    await store.close()
    assert store._follower is None
    assert await asyncio.wait_for(waiting, 5) == []  # the block's end
    await store.close()  # twice: nothing left to do


async def test_a_waiting_reader_rides_out_a_redis_restart_within_the_outage_grace(tmp_path: Path) -> None:
    """StreamBatchResults' waiting callers wait through a Redis restart shorter than the outage
    grace (LLAMAMESH_REDIS_OUTAGE_GRACE_S), as Generate streams do, and get the result that comes
    after it, instead of failing UNAVAILABLE at the first refused read."""
    server = RedisProcess("redis", tmp_path / "redis", appendonly=True, appendfsync="always")
    server.start()
    settings = RedisSettings(url=server.url)
    q = RedisQueue.from_settings(settings)
    reader = RedisBatches(q.client, q.keys, retention_s=60, follow_block_ms=200, outage_grace_s=30)
    writer = RedisBatches(q.client, q.keys, retention_s=60)
    observer = raw_client(settings, socket_timeout=5)
    try:
        (lease,) = await Stores(reader, writer, observer, "").batches(1)
        waiting = asyncio.create_task(reader.results("b0", "0-0", 0))
        await until(lambda: blocked_in(observer, "xread"), 10, "the reader's XREAD to block")
        with capture_logs() as logs:
            server.stop()  # a clean stop: the AOF keeps the batch

            def read_failed() -> bool:
                return any(e["event"] in ("event_read_retrying", "event_read_failed") for e in logs)

            await until(read_failed, 20, "the shared read to find Redis gone")
        server.start()
        assert not waiting.done()
        assert await writer.record(lease, ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "t"))
        got = await asyncio.wait_for(waiting, 20)
        assert [r.custom_id for _c, r in got] == ["b0-c"]
    finally:
        await reader.close()
        await observer.aclose()
        await q.close()
        server.stop()
