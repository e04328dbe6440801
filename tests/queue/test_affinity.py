"""Prefix affinity: partition streams owned by the pool's workers, own work first, steals when idle,
a dead worker's share moving on, with every guarantee of the plain streams (reclaim, dead letters,
acks, touches, fair share, bounds). On real servers and on the fake alike where the fake can."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any  # redis-py types stream replies loosely

import pytest
import redis.asyncio as aioredis

from llamamesh.errors import QueueFull, QueueMisconfigured
from llamamesh.queue.affinity import assign, partition_of
from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.queue.memory import MemoryQueue
from llamamesh.queue.protocol import QueueDepth, split_ref
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage, WorkerState, WorkerStatus
from tests.queue.conftest import raw_client, reader_blocked
from tests.queue.jobs import req
from tests.waiting import until

pytestmark = [pytest.mark.timeout(30)]

P = 4
TTL_S = 1.0
# The steal age of the shared queues: long enough that a loaded machine's pauses between a
# submission and the next lease never make a young job stealable.
STEAL_S = 1.0


def job(rid: str, key: str = "", tenant: str = "") -> GenerationRequest:
    return dataclasses.replace(req(rid), prefix_key=key, tenant=tenant)


def done() -> JobEvent:
    return JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, 1)))


def key_in(partitions: list[int]) -> str:
    """A prefix key whose partition is one of ``partitions``."""
    return next(k for i in itertools.count() if partition_of(job("x", k := f"conv-{i}"), P) in partitions)


def ids(leases: list[Any]) -> list[str]:
    return [x.request.request_id for x in leases]


async def beat(q: Any, worker: str, ttl_s: float = TTL_S, state: WorkerState = WorkerState.READY) -> None:
    await q.heartbeat(WorkerStatus(worker=worker, pool="cpu", state=state.value), ttl_s)


async def share(q1: Any, q2: Any | None = None, ttl_s: float = TTL_S) -> None:
    """Heartbeats of w1 (through q1) and w2 (through q2, else q1) until they own half each."""
    q2 = q2 or q1
    for _ in range(3):
        await beat(q1, "w1", ttl_s)
        await beat(q2, "w2", ttl_s)
    mine, theirs = q1.owned("cpu", "w1"), q2.owned("cpu", "w2")
    assert len(mine) == len(theirs) == P // 2 and sorted(mine + theirs) == list(range(P))


def settings_with(base: RedisSettings, partitions: int = P, steal_after_ms: int = 50) -> RedisSettings:
    return dataclasses.replace(base, affinity_partitions=partitions, affinity_steal_after_ms=steal_after_ms)


@pytest.fixture(params=["redis", "memory"])
async def queue(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryQueue(partitions=P, steal_after_ms=int(STEAL_S * 1000))
        return
    q = RedisQueue.from_settings(settings_with(redis_settings, steal_after_ms=int(STEAL_S * 1000)))
    await q.join("cpu")
    yield q
    await q.close()


@pytest.fixture
async def raw(redis_settings: RedisSettings) -> AsyncIterator[aioredis.Redis]:
    r = raw_client(redis_settings)
    yield r
    await r.aclose()


# ---- without Redis ------------------------------------------------------------


def test_the_ownership_step_shares_the_partitions_and_takes_a_dead_owners() -> None:
    owners, members, mine = assign({}, {}, "a", 0, 1000, 4)
    assert mine == [0, 1, 2, 3]
    owners, members, mine = assign(owners, members, "b", 10, 1000, 4)
    assert mine == []  # a's are live: b waits for a to give back its extras
    owners, members, mine = assign(owners, members, "a", 20, 1000, 4)
    assert mine == [0, 1]
    owners, members, mine = assign(owners, members, "b", 30, 1000, 4)
    assert mine == [2, 3]
    # a stops: past its expiry b holds all of them
    owners, members, mine = assign(owners, members, "b", 1025, 1000, 4)
    assert mine == [0, 1, 2, 3] and set(members) == {"b"}


def test_uneven_shares_converge_and_nobody_is_left_with_none() -> None:
    owners: dict[int, tuple[str, int]] = {}
    members: dict[str, int] = {}
    workers = ["a", "b", "c", "d", "e"]
    for now in range(0, 200, 10):  # heartbeats in turn, all alive
        for w in workers:
            owners, members, _mine = assign(owners, members, w, now, 1000, 16)
    counts = Counter(o for o, _u in owners.values())
    assert sorted(counts.values()) == [3, 3, 3, 3, 4] and set(counts) == set(workers)


def test_a_partition_follows_the_prefix_key_or_else_the_request_id() -> None:
    assert partition_of(job("a", "k"), 16) == partition_of(job("b", "k"), 16)
    assert len({partition_of(job(f"r{i}"), 16) for i in range(200)}) == 16


# ---- both ---------------------------------------------------------------------


@pytest.mark.redis
async def test_a_new_worker_gets_its_share_and_a_starting_one_none(queue: Any) -> None:
    await beat(queue, "w1")
    assert queue.owned("cpu", "w1") == list(range(P))
    await beat(queue, "w0", state=WorkerState.STARTING)  # not leasing yet: takes nothing
    await beat(queue, "w1")
    assert queue.owned("cpu", "w1") == list(range(P))
    await share(queue)
    for _ in range(3):  # a third: P = 4 shares out as 2 / 1 / 1, none left with nothing
        for w in ("w1", "w2", "w3"):
            await beat(queue, w)
    assert sorted(len(queue.owned("cpu", w)) for w in ("w1", "w2", "w3")) == [1, 1, 2]
    await queue.leave("cpu", "w3")
    await share(queue)
    await queue.leave("cpu", "w2")  # a clean stop gives its share back at once
    await beat(queue, "w1")
    assert queue.owned("cpu", "w1") == list(range(P))


@pytest.mark.redis
async def test_the_same_prefix_key_goes_to_the_worker_that_owns_it(queue: Any) -> None:
    await share(queue)
    a, b = key_in(queue.owned("cpu", "w1")), key_in(queue.owned("cpu", "w2"))
    for i in range(3):
        await queue.submit("cpu", job(f"a{i}", a))
        await queue.submit("cpu", job(f"b{i}", b))
    mine = await queue.lease("cpu", "w1", 10, 0)
    theirs = await queue.lease("cpu", "w2", 10, 0)
    assert ids(mine) == ["a0", "a1", "a2"] and ids(theirs) == ["b0", "b1", "b2"]
    assert not any(x.stolen for x in mine + theirs)
    assert {x.partition for x in mine} == {partition_of(job("x", a), P)}
    # the owner, blocked on its own partitions, gets the next one at once
    waiting = asyncio.create_task(queue.lease("cpu", "w1", 1, 2000))
    await until(lambda: reader_blocked(queue, "xreadgroup"), 10, "w1's blocking read of its own partitions")
    await queue.submit("cpu", job("a3", a))
    (got,) = await waiting
    assert got.request.request_id == "a3" and not got.stolen


@pytest.mark.redis
async def test_an_idle_worker_steals_a_busy_owners_queued_job_within_the_bound(queue: Any) -> None:
    await share(queue)
    a = key_in(queue.owned("cpu", "w1"))
    # w1 is busy (it does not lease): w2, idle, blocked on its own partitions, takes w1's job
    thief = asyncio.create_task(queue.lease("cpu", "w2", 1, 5000))
    await until(lambda: reader_blocked(queue, "xreadgroup"), 10, "w2's blocking read of its own partitions")
    t0 = time.monotonic()
    await queue.submit("cpu", job("a0", a))
    (got,) = await thief
    assert got.request.request_id == "a0" and got.stolen
    assert time.monotonic() - t0 < 2 * STEAL_S + 0.5  # twice steal_after_ms, plus slack for a loaded machine
    # a steal takes only jobs that waited steal_after_ms (the owner, with room, gets them first), the
    # oldest first, and only when the thief has nothing of its own
    b = key_in(queue.owned("cpu", "w2"))
    await queue.submit("cpu", job("a1", a))
    await queue.submit("cpu", job("a2", a))
    assert await queue.lease("cpu", "w2", 5, 0) == []
    await queue.submit("cpu", job("b0", b))
    assert ids(await queue.lease("cpu", "w2", 5, 0)) == ["b0"]
    stolen = await queue.lease("cpu", "w2", 5, 1000)
    assert ids(stolen) == ["a1", "a2"] and all(x.stolen for x in stolen)


@pytest.mark.redis
async def test_a_dead_workers_partitions_move_to_the_others(queue: Any) -> None:
    ttl = 0.3
    await share(queue, ttl_s=ttl)
    a = key_in(queue.owned("cpu", "w1"))
    await asyncio.sleep(ttl + 0.1)  # time passing on purpose: w1 stops heartbeating, its heartbeat's TTL runs out
    await beat(queue, "w2", ttl)
    assert queue.owned("cpu", "w2") == list(range(P))
    await queue.submit("cpu", job("a0", a))
    (got,) = await queue.lease("cpu", "w2", 1, 0)
    assert got.request.request_id == "a0" and not got.stolen


# ---- Redis ----------------------------------------------------------------------


@pytest.mark.redis
async def test_a_dead_workers_leased_jobs_are_reclaimed_once_and_poison_is_set_aside(
    redis_settings: RedisSettings, raw: aioredis.Redis
) -> None:
    q = RedisQueue.from_settings(settings_with(redis_settings))
    keys = Keys(redis_settings.prefix)
    try:
        await q.join("cpu")
        ttl = 0.3
        await share(q, ttl_s=ttl)
        a = key_in(q.owned("cpu", "w1"))
        for i in range(3):
            await q.submit("cpu", job(f"a{i}", a, tenant="t" if i else ""))
        assert len(await q.lease("cpu", "w1", 3, 0)) == 3
        await asyncio.sleep(ttl + 0.1)  # time passing on purpose: w1 died with its jobs leased, its TTL runs out
        await beat(q, "w2", ttl)
        got = await asyncio.gather(q.reclaim("cpu", "w2", 200, 10, 3), q.reclaim("cpu", "w3", 200, 10, 3))
        assert sorted(ids([x for leases in got for x in leases])) == ["a0", "a1", "a2"]
        assert all(x.partition == partition_of(job("x", a), P) for leases in got for x in leases)
        # the reclaimed jobs keep their refs: touched, they stay; acked, they leave their partition
        taken = {x.request.request_id: x for x in got[0] + got[1]}
        assert split_ref(taken["a1"].ref) == ("t", taken["a1"].partition, taken["a1"].entry_id)
        await q.publish([(taken["a0"], done())], [])
        await asyncio.sleep(0.25)  # time passing on purpose: a1 and a2 age past the 200 ms idle time
        # a1's taker (either reclaimer may have won the race) touches it: it stays
        holder = "w2" if any(x.request.request_id == "a1" for x in got[0]) else "w3"
        await q.heartbeat(WorkerStatus(worker=holder, pool="cpu"), ttl, touch=[taken["a1"].ref])
        # a2 was untouched: delivered twice already, its next taker is its third, past 2 deliveries
        assert await q.reclaim("cpu", "w4", 200, 10, max_deliveries=2) == []
        dead: Any = await raw.xrange(keys.dead_letters("cpu"))
        assert len(dead) == 1 and dead[0][1][b"deliveries"] == b"3"
        evs = [e async for _i, e in q.events("a2")]
        assert evs[-1].failed is not None and "set aside" in evs[-1].failed.message
        assert await q.queue_depth("cpu") == QueueDepth(0, 1)  # a1, running on its holder
        stream = keys.jobs_part("cpu", "t", partition_of(job("x", a), P))
        assert (await raw.xpending(stream, WORKER_GROUP))["pending"] == 1
    finally:
        await q.close()


@pytest.mark.redis
async def test_fair_share_between_tenants_holds_with_affinity_on(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(settings_with(redis_settings))
    try:
        await q.join("cpu")
        await beat(q, "w1")  # one worker: it owns every partition
        for i in range(100):  # no prefix key: spread over the partitions by request id
            await q.submit("cpu", job(f"a{i}", tenant="a"), weight=3.0)
            await q.submit("cpu", job(f"b{i}", tenant="b"), weight=1.0)
        got: Counter[str] = Counter()
        b_times: list[int] = []
        for _ in range(20):
            leases = await q.lease("cpu", "w1", 4, 200)
            assert len(leases) == 4
            got.update(x.request.tenant for x in leases)
            b_times += [int(x.entry_id.split("-")[0]) for x in leases if x.tenant == "b"]
        assert got == {"a": 60, "b": 20}
        # each tenant's jobs oldest first across its partitions (to the millisecond: entry ids of
        # different streams in one millisecond do not order)
        assert b_times == sorted(b_times)
        # two workers: each one's own share is fair as well
        await share(q)
        more: Counter[str] = Counter()
        for _ in range(5):
            for w in ("w1", "w2"):
                more.update(x.request.tenant for x in await q.lease("cpu", w, 4, 200))
        assert more == {"a": 30, "b": 10}
    finally:
        await q.close()


@pytest.mark.redis
async def test_depth_bounds_and_idle_tenants_count_every_partition(
    redis_settings: RedisSettings, raw: aioredis.Redis
) -> None:
    q = RedisQueue.from_settings(dataclasses.replace(settings_with(redis_settings), consumer_idle_s=3600))
    keys = Keys(redis_settings.prefix)
    try:
        await q.join("cpu")
        for i in range(3):  # three keys: three partitions, one bound
            await q.submit("cpu", job(f"b{i}", f"k{i}", tenant="b"), max_waiting=3)
        with pytest.raises(QueueFull, match="tenant 'b'"):
            await q.submit("cpu", job("b3", "k3", tenant="b"), max_waiting=3)
        leases = await q.lease("cpu", "w1", 1, 200)  # owning nothing yet: a steal
        assert len(leases) == 1 and leases[0].stolen
        assert await q.queue_depth("cpu") == QueueDepth(2, 1)
        await q.submit("cpu", job("b3", "k3", tenant="b"), max_waiting=3)
        await beat(q, "w1")  # now it owns them all
        rest = await q.lease("cpu", "w1", 10, 200)
        assert len(rest) == 3 and not any(x.stolen for x in rest)
        await q.publish([(x, done()) for x in leases + rest], [])
        assert await q.queue_depth("cpu") == QueueDepth(0, 0)
        await q.prune_consumers("cpu")  # b holds nothing in any partition: forgotten
        assert await raw.hgetall(keys.tenants("cpu")) == {}
        assert not await raw.exists(*(keys.jobs_part("cpu", "b", k) for k in range(P)))
    finally:
        await q.close()


@pytest.mark.redis
async def test_gateways_and_workers_of_a_pool_must_agree_on_the_partitions(redis_settings: RedisSettings) -> None:
    on = RedisQueue.from_settings(settings_with(redis_settings))
    off = RedisQueue.from_settings(redis_settings)
    other = RedisQueue.from_settings(settings_with(redis_settings, partitions=8))
    try:
        await off.join("plain")  # off everywhere: nothing recorded, nothing refused
        await off.submit("plain", job("p0"))
        await on.submit("cpu", job("x0", "k"))  # the first to use the pool records its partitions
        with pytest.raises(QueueMisconfigured, match="4 affinity partitions"):
            await off.submit("cpu", job("x1"))
        with pytest.raises(QueueMisconfigured):
            await other.join("cpu")
        with pytest.raises(QueueMisconfigured):
            await off.heartbeat(WorkerStatus(worker="w9", pool="cpu"), 1.0)
        # a pool used with affinity off records nothing: the first to turn it on records it, and
        # the workers still off learn it at their next heartbeat (withdrawn: no job goes unread)
        await on.submit("plain", job("p1", "k"))
        with pytest.raises(QueueMisconfigured):
            await off.heartbeat(WorkerStatus(worker="w8", pool="plain"), 1.0)
    finally:
        for q in (on, off, other):
            await q.close()


@pytest.mark.redis
async def test_off_the_plain_stream_layout_is_kept(redis_settings: RedisSettings, raw: aioredis.Redis) -> None:
    q = RedisQueue.from_settings(redis_settings)
    keys = Keys(redis_settings.prefix)
    try:
        await q.join("cpu")
        await q.submit("cpu", job("x", "key"))
        await beat(q, "w1")
        assert await raw.xlen(keys.jobs("cpu")) == 1
        assert not await raw.exists(keys.owners("cpu"), keys.partitions("cpu"))
        (lease,) = await q.lease("cpu", "w1", 1, 200)
        assert lease.partition is None and lease.request.prefix_key == "key" and lease.ref == lease.entry_id
    finally:
        await q.close()
