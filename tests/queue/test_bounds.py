"""Bounded over days: nothing the queue writes grows without end (on redis-server and Valkey).

Each test states one bound: the dead-letter stream's length, the consumers of a pool's groups, an
owner's batch list, an event stream's life while its request runs (and the worker's table of it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.groups import create_group
from llamamesh.queue.keys import WORKER_GROUP
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import connect
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import (
    Attempt,
    BatchInfo,
    BatchState,
    Finished,
    FinishReason,
    GenerationRequest,
    ItemResult,
    ItemStatus,
    JobEvent,
    Usage,
)
from tests.queue.conftest import raw_client
from tests.queue.jobs import req
from tests.waiting import until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def raw(redis_settings: RedisSettings) -> AsyncIterator[aioredis.Redis]:
    r = raw_client(redis_settings)
    yield r
    await r.aclose()


async def test_the_dead_letter_stream_keeps_about_its_maxlen(redis_settings: RedisSettings, raw) -> None:
    settings = dataclasses.replace(redis_settings, dead_letter_maxlen=10)
    q = RedisQueue.from_settings(settings)
    try:
        for i in range(500):
            await q.set_aside("cpu", req(f"p{i}"), "poison", 3)
        key = q.keys.dead_letters("cpu")
        # Trimmed approximately: whole stream nodes (100 entries each by default) go, never more.
        assert 10 <= await raw.xlen(key) <= 110
        newest = await raw.xrevrange(key, count=1)
        assert b"p499" in newest[0][1][b"j"]
    finally:
        await q.close()


async def consumers(r: aioredis.Redis, stream: str) -> dict[str, dict]:
    return {c["name"].decode(): c for c in await r.xinfo_consumers(stream, WORKER_GROUP)}


async def test_idle_consumers_holding_nothing_leave_the_pools_groups(redis_settings: RedisSettings, raw) -> None:
    """A dead worker's name holding no entry goes; one still holding a leased job stays (its job is
    not lost); a live one that leases again is simply back."""
    settings = dataclasses.replace(redis_settings, consumer_idle_s=1)
    clock = Clock()
    q = RedisQueue(connect(settings), settings, clock=clock)
    jobs, items = q.keys.jobs("cpu"), q.keys.batch_items("cpu")
    try:
        await q.join("cpu")
        await create_group(q.client, items)
        await q.submit("cpu", req("held"))
        assert len(await q.lease("cpu", "host-1", 1, 50)) == 1  # dies holding a job
        await q.submit("cpu", req("ran"))
        (ran,) = await q.lease("cpu", "host-2", 1, 50)  # finishes its job, then dies holding nothing
        await q.publish([(ran, JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, 0))))], [])
        await raw.xgroup_createconsumer(items, WORKER_GROUP, "host-2")  # its batch side too
        assert set(await consumers(raw, jobs)) == {"host-1", "host-2"}

        async def idle_enough() -> bool:
            seen = [*(await consumers(raw, jobs)).values(), *(await consumers(raw, items)).values()]
            return all(c["idle"] >= 1000 for c in seen)

        await until(idle_enough, 10, "every consumer idle for the server's 1 s", poll_s=0.05)
        await q.workers("cpu")  # the gateway's periodic look at the pool
        assert set(await consumers(raw, jobs)) == {"host-1"}
        assert await consumers(raw, items) == {}
        assert (await raw.xpending(jobs, WORKER_GROUP))["pending"] == 1  # host-1's job waits to be reclaimed

        # At most one prune per interval (min(60 s, consumer_idle_s)) per pool.
        await raw.xgroup_createconsumer(jobs, WORKER_GROUP, "host-3")

        async def host3_idle() -> bool:
            return (await consumers(raw, jobs))["host-3"]["idle"] >= 1000

        await until(host3_idle, 10, "host-3 idle for the server's 1 s", poll_s=0.05)
        clock.now += 0.5
        await q.workers("cpu")
        assert "host-3" in await consumers(raw, jobs)
        clock.now += 1.0
        await q.workers("cpu")
        assert set(await consumers(raw, jobs)) == {"host-1"}
        assert len(await q.reclaim("cpu", "host-4", 0, 10, max_deliveries=3)) == 1  # nothing was lost
    finally:
        await q.close()


async def test_a_recently_seen_consumer_is_kept(redis_settings: RedisSettings, raw) -> None:
    q = RedisQueue.from_settings(dataclasses.replace(redis_settings, consumer_idle_s=3600))
    try:
        await q.join("cpu")
        await q.submit("cpu", req("a"))
        (job,) = await q.lease("cpu", "live", 1, 50)
        await q.publish([(job, JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, 0))))], [])
        assert await q.prune_consumers("cpu") == 0
        assert set(await consumers(raw, q.keys.jobs("cpu"))) == {"live"}
    finally:
        await q.close()


def batch(bid: str, owner: str, n: int = 1) -> tuple[BatchInfo, list[tuple[str, GenerationRequest]]]:
    now = time.time()
    info = BatchInfo(
        batch_id=bid,
        state=BatchState.VALIDATING,
        owner=owner,
        model="m",
        total=n,
        completion_window_s=3600,
        created_at=now,
        expires_at=now + 3600,
    )
    items = [
        ("cpu", GenerationRequest(request_id=f"b:{bid}:{i}", model="m", prompt="p", batch_id=bid, custom_id=f"c{i}"))
        for i in range(n)
    ]
    return info, items


async def test_the_sweep_takes_purged_batches_off_their_owners_list(redis_settings: RedisSettings, raw) -> None:
    """Without anyone listing them: a batch whose retention ended leaves its owner's sorted set, a
    bounded page per sweep; a batch still running stays listed."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=1)
    try:
        await store.join("cpu")
        for bid in ("d1", "d2", "d3"):
            info, items = batch(bid, "o")
            await store.create(info, "fp", items)
            (lease,) = await store.lease_items("cpu", "w", 1, 100)
            assert await store.record(lease, ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "t"))
        info, items = batch("live", "o")
        await store.create(info, "fp", items)
        assert await raw.zcard(q.keys.batches("o")) == 4

        async def purged() -> bool:
            return not await raw.exists(*(q.keys.batch(b) for b in ("d1", "d2", "d3")))

        await until(purged, 10, "the ended batches' retention (1 s) to end on the server", poll_s=0.05)
        await store.sweep(limit=2)  # bounded work per sweep
        assert await raw.zcard(q.keys.batches("o")) == 2
        await store.sweep()
        assert await raw.zrange(q.keys.batches("o"), 0, -1) == [b"live"]
        assert await raw.zcard(q.keys.batches_kept()) == 1  # the live one, looked at again later
        assert (await raw.zscore(q.keys.batches_kept(), '["o", "live"]') or 0) > time.time()
    finally:
        await q.close()


def lease(rid: str) -> Lease:
    return Lease(pool="cpu", entry_id="0-1", request=req(rid))


async def test_a_running_requests_event_stream_is_renewed_and_an_abandoned_one_expires(
    redis_settings: RedisSettings, raw
) -> None:
    settings = dataclasses.replace(redis_settings, event_idle_ttl_s=100)
    clock = Clock()
    q = RedisQueue(connect(settings), settings, clock=clock)
    key, attempts = q.keys.events("long"), q.keys.attempts("long")
    try:
        await q.begin("long", Attempt(attempt_id="long", base=0, pool="cpu", model="m", accepted_unix_ns=0), first=True)
        await q.publish([(lease("long"), JobEvent(text="a", token_ids=(1,), index=0))], [])
        assert 90 < await raw.ttl(key) <= 100
        # Time passes (its TTL runs down), the request goes on producing tokens.
        await raw.pexpire(key, 3000)
        await raw.pexpire(attempts, 3000)
        clock.now += 10  # sooner than a quarter of the TTL: no renewal (no extra command)
        await q.publish([(lease("long"), JobEvent(text="b", token_ids=(2,), index=1))], [])
        assert await raw.pttl(key) <= 3000
        clock.now += 20
        await q.publish([(lease("long"), JobEvent(text="c", token_ids=(3,), index=2))], [])
        assert 90 < await raw.ttl(key) <= 100  # renewed while it runs
        assert 90 < await raw.ttl(attempts) <= 100  # and its caller's attempts record with it
        # Abandoned (its worker gone): nothing renews it, it runs down and expires.
        await raw.pexpire(key, 100)

        async def expired() -> bool:
            return not await raw.exists(key)

        await until(expired, 10, "the abandoned event stream's TTL to run out", poll_s=0.05)
        done = JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, 3)))
        await q.publish([(lease("short"), JobEvent(text="a", token_ids=(1,))), (lease("short"), done)], [])
        assert 0 < await raw.ttl(q.keys.events("short")) <= settings.event_ttl_s
    finally:
        await q.close()


async def test_the_workers_renewal_table_forgets_ended_and_abandoned_requests(redis_settings: RedisSettings) -> None:
    settings = dataclasses.replace(redis_settings, event_idle_ttl_s=100)
    clock = Clock()
    q = RedisQueue(connect(settings), settings, clock=clock)
    done = JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, 1)))
    try:
        for i in range(3):
            await q.publish([(lease(f"e{i}"), JobEvent(text="a", token_ids=(1,))), (lease(f"e{i}"), done)], [])
        assert len(q._events.renew_at) == 0  # ended requests are forgotten with their terminal event
        await q.publish([(lease(f"gone{i}"), JobEvent(text="a", token_ids=(1,))) for i in range(1500)], [])
        clock.now += 1000  # those were given up long ago (no terminal event ever came)
        await q.publish([(lease(f"new{i}"), JobEvent(text="a", token_ids=(1,))) for i in range(10)], [])
        assert len(q._events.renew_at) == 10
    finally:
        await q.close()
