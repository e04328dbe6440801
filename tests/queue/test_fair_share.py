"""Fair share between the tenants of a pool: a work stream per tenant, leased by weighted deficit
round robin, with every guarantee of the single stream (reclaim, dead letters, bounds, acks)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from typing import Any  # redis-py types stream replies loosely

import pytest
import redis.asyncio as aioredis

from llamamesh.errors import QueueFull
from llamamesh.queue.fair import FairShare
from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.queue.memory import MemoryQueue
from llamamesh.queue.protocol import Lease, entry_ref, parse_ref
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage, WorkerStatus
from tests.queue.conftest import raw_client, reader_blocked
from tests.queue.jobs import req
from tests.waiting import until

pytestmark = [pytest.mark.timeout(30)]


def job(rid: str, tenant: str) -> GenerationRequest:
    return dataclasses.replace(req(rid), tenant=tenant)


def done() -> JobEvent:
    return JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, 1)))


def tenants_of(leases: list[Lease]) -> list[str]:
    return [x.request.tenant for x in leases]


@pytest.fixture
async def raw(redis_settings: RedisSettings):
    r = raw_client(redis_settings)
    yield r
    await r.aclose()


# ---- the plan, without Redis ------------------------------------------------


def test_the_plan_fills_the_slots_by_weight_and_an_empty_tenant_keeps_no_credit() -> None:
    fair = FairShare()
    fair.set_tenants({"a": 3.0, "b": 1.0})
    got: Counter[str] = Counter()
    for _ in range(25):
        asks = fair.plan(4, {"a", "b"})
        assert sum(asks.values()) == 4
        got.update(asks)
    assert got == {"a": 75, "b": 25}
    # b has nothing: what it was asked goes unserved and its deficit drops; a gets every slot
    fair.served("b", 1, 0)
    assert fair.plan(4, {"a"}) == {"a": 4}
    assert fair.plan(0, {"a"}) == {} and fair.plan(3, set()) == {}


def test_the_plan_goes_on_with_a_turn_cut_short_by_the_slots() -> None:
    fair = FairShare()
    fair.set_tenants({"a": 4.0, "b": 1.0})
    assert fair.plan(2, {"", "a", "b"}) == {"": 1, "a": 1}  # a's turn (4) cut short
    assert fair.plan(3, {"", "a", "b"}) == {"a": 3}  # ... and finished on the next lease
    assert fair.plan(1, {"", "a", "b"}) == {"b": 1}


def test_refs_name_an_entry_of_every_tenants_stream() -> None:
    assert entry_ref("", "1-0") == "1-0" and parse_ref("1-0") == ("", "1-0")
    assert entry_ref("b", "1-0") == "1-0@b" and parse_ref("1-0@b") == ("b", "1-0")
    assert Lease("cpu", "1-0", req("x"), tenant="b").ref == "1-0@b"


def test_the_default_tenant_keeps_the_pools_plain_work_stream() -> None:
    keys = Keys("p")
    assert keys.jobs("cpu") == keys.jobs("cpu", "") == keys.jobs("cpu", "default") == "p:pool:{cpu}:jobs"
    assert keys.jobs("cpu", "b") == "p:pool:{cpu}:jobs:t:b"  # same hash tag: one slot per pool


# ---- Redis --------------------------------------------------------------------


@pytest.mark.redis
async def test_a_small_tenant_behind_a_burst_is_leased_at_once(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    for i in range(200):
        await q.submit("cpu", job(f"a{i}", "a"))
    for i in range(5):
        await q.submit("cpu", job(f"b{i}", "b"))
    first = await q.lease("cpu", "w1", 4, 200)
    second = await q.lease("cpu", "w1", 4, 200)
    assert len(first) == len(second) == 4
    assert "b" in tenants_of(first) and tenants_of(first + second).count("b") >= 2
    # each tenant's jobs in its own order
    got = [x.request.request_id for x in first + second]
    assert [r for r in got if r[0] == "a"] == [f"a{i}" for i in range(sum(r[0] == "a" for r in got))]
    assert [x.tenant for x in first + second] == tenants_of(first + second)


@pytest.mark.redis
async def test_weights_share_the_workers_while_both_have_work(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    for i in range(100):
        await q.submit("cpu", job(f"a{i}", "a"), weight=3.0)
        await q.submit("cpu", job(f"b{i}", "b"), weight=1.0)
    got: Counter[str] = Counter()
    for _ in range(20):
        leases = await q.lease("cpu", "w1", 4, 200)
        assert len(leases) == 4
        got.update(tenants_of(leases))
    assert got == {"a": 60, "b": 20}
    # b alone: every slot is b's (an empty tenant holds none back)
    rest = [x for _ in range(30) for x in await q.lease("cpu", "w1", 4, 50)]
    assert Counter(tenants_of(rest)) == {"a": 40, "b": 80}


@pytest.mark.redis
async def test_a_lease_never_takes_more_than_its_count(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    for t in ("a", "b", "c", "d", "e"):
        await q.submit("cpu", job(f"{t}0", t))
    assert len(await q.lease("cpu", "w1", 3, 200)) == 3
    assert len(await q.lease("cpu", "w1", 3, 200)) == 2


@pytest.mark.redis
async def test_a_blocking_read_that_finds_several_streams_filled_gives_back_past_its_count(
    redis_queue: RedisQueue,
) -> None:
    q = redis_queue
    await q.join("cpu")
    for t in ("a", "b", "c"):
        await q.submit("cpu", job(f"{t}1", t))
    # the blocking read itself (lease() reaches it only once every stream looked empty: then a race
    # can fill several at once): the jobs past the count go back to their streams, unleased
    fair = await q._leasing.fair_share("cpu")
    (kept,) = await q._leasing._block("cpu", "w1", 1, 100, fair, (), [None])
    again = {x.request.request_id for x in await q.lease("cpu", "w2", 10, 100)}
    assert again == {"a1", "b1", "c1"} - {f"{kept.tenant}1"}
    assert await q.reclaim("cpu", "w3", 0, 10, 3) != []  # w1 holds its one, w2 its two: nothing else


@pytest.mark.redis
async def test_a_new_tenant_is_seen_within_one_block(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    t0 = time.monotonic()
    blocked = asyncio.create_task(q.lease("cpu", "w1", 4, 300))
    await until(lambda: reader_blocked(q, "xreadgroup"), 10, "the worker's blocking read of the streams it knows")
    await q.submit("cpu", job("b0", "b"))
    leases = await blocked
    if not leases:  # the block did not cover b's stream: the next lease reads the tenants again
        leases = await q.lease("cpu", "w1", 4, 300)
    assert [x.request.request_id for x in leases] == ["b0"]
    assert time.monotonic() - t0 < 0.3 + 0.5 + 0.2


@pytest.mark.redis
async def test_reclaim_takes_a_dead_workers_jobs_of_every_tenant(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    for rid, t in (("d", ""), ("a", "a"), ("b", "b"), ("b2", "b")):
        await q.submit("cpu", job(rid, t))
    dead = await q.lease("cpu", "dead", 10, 200)
    assert len(dead) == 4
    mine = await q.lease("cpu", "w2", 10, 50)
    assert mine == []
    await asyncio.sleep(0.3)  # time passing on purpose: the dead worker's entries age past the 200 ms idle time
    # w2 runs nothing; a third reclaimer racing it gets nothing twice
    got = await asyncio.gather(q.reclaim("cpu", "w2", 200, 10, 3), q.reclaim("cpu", "w3", 200, 10, 3))
    ids = sorted(x.request.request_id for leases in got for x in leases)
    assert ids == ["a", "b", "b2", "d"]
    tenants = {x.request.request_id: x.tenant for leases in got for x in leases}
    assert tenants == {"d": "", "a": "a", "b": "b", "b2": "b"}
    # the count holds across streams, and a restart under the same name takes its own back
    await asyncio.sleep(0.3)  # time passing on purpose: the reclaimed entries age past the idle time again
    assert len(await q.reclaim("cpu", "w4", 200, 3, 5)) == 3
    assert len(await q.reclaim("cpu", "w4", 0, 10, 5, own=True)) == 3


@pytest.mark.redis
async def test_a_running_job_is_not_reclaimed_from_its_own_worker(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    await q.submit("cpu", job("b0", "b"))
    await q.submit("cpu", job("b1", "b"))
    leases = {x.request.request_id: x for x in await q.lease("cpu", "w1", 2, 200)}
    await asyncio.sleep(0.3)  # time passing on purpose: both entries age past the 200 ms idle time
    # it runs b0 (by its ref in b's stream), not b1 (a lease whose reply it lost)
    got = await q.reclaim("cpu", "w1", 200, 10, 3, running={leases["b0"].ref})
    assert [x.request.request_id for x in got] == ["b1"]


@pytest.mark.redis
async def test_heartbeat_touch_keeps_another_tenants_running_job(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    await q.submit("cpu", job("busy", "b"))
    await q.submit("cpu", job("orphan", "b"))
    await q.submit("cpu", job("plain", ""))
    leases = {x.request.request_id: x for x in await q.lease("cpu", "w1", 3, 200)}
    await asyncio.sleep(0.3)  # time passing on purpose: the entries age past the 200 ms idle time
    touch = [leases["busy"].ref, leases["plain"].ref]
    await q.heartbeat(WorkerStatus(worker="w1", pool="cpu"), 1.0, touch=touch)
    assert [x.request.request_id for x in await q.reclaim("cpu", "w2", 200, 10, 3)] == ["orphan"]


@pytest.mark.redis
async def test_a_tenants_job_is_acked_and_deleted_after_its_terminal_event(
    redis_queue: RedisQueue, redis_settings: RedisSettings, raw: aioredis.Redis
) -> None:
    q, stream = redis_queue, Keys(redis_settings.prefix).jobs("cpu", "b")
    await q.join("cpu")
    await q.submit("cpu", job("t", "b"))
    (lease,) = await q.lease("cpu", "w1", 1, 200)
    assert lease.tenant == "b" and (await raw.xpending(stream, WORKER_GROUP))["pending"] == 1
    await q.publish([(lease, done())], [])
    assert (await raw.xpending(stream, WORKER_GROUP))["pending"] == 0
    assert await raw.xlen(stream) == 0


@pytest.mark.redis
async def test_a_tenants_poison_job_is_dead_lettered(
    redis_queue: RedisQueue, redis_settings: RedisSettings, raw: aioredis.Redis
) -> None:
    q, keys = redis_queue, Keys(redis_settings.prefix)
    await q.join("cpu")
    await q.submit("cpu", job("poison", "b"))
    assert len(await q.lease("cpu", "w1", 1, 200)) == 1
    await asyncio.sleep(0.25)  # time passing on purpose: the entry ages past the 200 ms idle time
    assert len(await q.reclaim("cpu", "w2", 200, 10, max_deliveries=2)) == 1
    await asyncio.sleep(0.25)  # and again
    assert await q.reclaim("cpu", "w3", 200, 10, max_deliveries=2) == []
    evs = [e async for _i, e in q.events("poison")]
    assert evs[-1].failed is not None and "set aside" in evs[-1].failed.message
    dead: Any = await raw.xrange(keys.dead_letters("cpu"))
    assert len(dead) == 1 and dead[0][1][b"deliveries"] == b"3"
    assert (await raw.xpending(keys.jobs("cpu", "b"), WORKER_GROUP))["pending"] == 0
    assert await raw.xlen(keys.jobs("cpu", "b")) == 0


@pytest.mark.redis
async def test_the_waiting_bound_is_per_tenant(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    for i in range(3):
        await q.submit("cpu", job(f"a{i}", "a"), max_waiting=3)
    with pytest.raises(QueueFull, match="tenant 'a'"):
        await q.submit("cpu", job("a3", "a"), max_waiting=3)
    for i in range(3):  # a's full queue does not refuse b
        await q.submit("cpu", job(f"b{i}", "b"), max_waiting=3)
    assert tenants_of(await q.lease("cpu", "w1", 2, 200)) == ["a", "b"]
    await q.submit("cpu", job("a3", "a"), max_waiting=3)  # a leased one: room for one more


@pytest.mark.redis
async def test_a_retried_submission_is_queued_once(
    redis_queue: RedisQueue, redis_settings: RedisSettings, raw: aioredis.Redis
) -> None:
    q = redis_queue
    await q.submit("cpu", job("x", "b"), weight=2.0)
    await q.submit("cpu", job("x", "b"), weight=2.0)  # the same write again
    keys = Keys(redis_settings.prefix)
    assert await raw.xlen(keys.jobs("cpu", "b")) == 1
    assert await raw.hgetall(keys.tenants("cpu")) == {b"b": b"2.0"}


@pytest.mark.redis
async def test_an_idle_tenant_is_forgotten_and_comes_back_with_its_next_job(
    redis_settings: RedisSettings, raw: aioredis.Redis
) -> None:
    q = RedisQueue.from_settings(dataclasses.replace(redis_settings, consumer_idle_s=3600))
    keys = Keys(redis_settings.prefix)
    try:
        await q.join("cpu")
        await q.submit("cpu", job("b0", "b"))
        await q.submit("cpu", job("c0", "c"))
        leases = await q.lease("cpu", "w1", 2, 200)
        await q.publish([(x, done()) for x in leases], [])
        # a worker blocks on every stream it knows; the idle ones go under it
        waiting = asyncio.create_task(q.lease("cpu", "w1", 1, 1000))
        await until(lambda: reader_blocked(q, "xreadgroup"), 10, "the worker's blocking read")
        await q.prune_consumers("cpu")
        assert await raw.hgetall(keys.tenants("cpu")) == {}
        assert not await raw.exists(keys.jobs("cpu", "b"), keys.jobs("cpu", "c"))
        assert await waiting == []  # its blocked read of a stream that went away ends, quietly
        assert not await raw.exists(keys.jobs("cpu", "b"))  # and does not make it again
        await q.submit("cpu", job("b1", "b"))
        assert [x.request.request_id for x in await q.lease("cpu", "w1", 1, 200)] == ["b1"]
    finally:
        await q.close()


# ---- the fake ---------------------------------------------------------------


async def test_the_fake_leases_tenants_in_round_robin() -> None:
    q = MemoryQueue()
    for i in range(6):
        await q.submit("cpu", job(f"a{i}", "a"))
    await q.submit("cpu", job("b0", "b"), weight=2.0)
    await q.submit("cpu", job("b1", "b"), weight=2.0)
    assert [x.request.request_id for x in await q.lease("cpu", "w", 3, 10)] == ["a0", "b0", "a1"]
    assert [x.request.request_id for x in await q.lease("cpu", "w", 3, 10)] == ["b1", "a2", "a3"]
    assert q.weights["cpu"] == {"a": 1.0, "b": 2.0}
    with pytest.raises(QueueFull):
        await q.submit("cpu", job("a9", "a"), max_waiting=2)
    await q.submit("cpu", job("b2", "b"), max_waiting=2)
