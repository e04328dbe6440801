"""The queue through Redis Sentinel (``redis+sentinel://``): a primary, a replica and three
Sentinels, real processes started here. The queue contract holds through it; the writes a client
is told about are on the replica when the call returns (WAIT), or the call fails UNAVAILABLE; a
Sentinel that is down is skipped; after SENTINEL FAILOVER (the old primary stays up) the client
writes to the new primary within a second or two, none to the old one after."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from llamamesh.errors import QueueUnavailable
from llamamesh.queue import codec
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP
from llamamesh.queue.redisio import PRIMARY_RECHECK_S
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import Finished, FinishReason, ItemResult, ItemStatus, JobEvent, Usage
from tests.queue.jobs import req
from tests.queue.test_batches import batch
from tests.redisproc import RedisProcess, SentinelGroup
from tests.waiting import until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

KIND = "redis" if shutil.which("redis-server") else "valkey"


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    g = SentinelGroup(KIND, tmp_path_factory.mktemp("sentinel"), replicas=1)
    g.start()
    yield g
    g.stop()


def settings_of(group: SentinelGroup, **kw: object) -> RedisSettings:
    return RedisSettings(url=group.url, prefix=f"test:{uuid.uuid4().hex[:10]}", block_ms=200, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def queue(group: SentinelGroup) -> AsyncIterator[RedisQueue]:
    q = RedisQueue.from_settings(settings_of(group, wait_replicas=1))
    yield q
    await q.close()


def direct(server: RedisProcess) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


async def test_submit_lease_publish_events_ack_through_sentinel(group: SentinelGroup, queue: RedisQueue) -> None:
    q = queue
    primary, replica = group.primary(), group.servers[1]
    stream = q.keys.jobs("cpu")
    await q.join("cpu")
    await q.submit("cpu", req("a"))
    with direct(replica) as r:  # WAIT 1: on the replica when submit returned
        assert r.xlen(stream) == 1
    (lease,) = await q.lease("cpu", "w1", 10, 500)
    assert lease.request == req("a") and not lease.cancelled
    await q.publish([(lease, JobEvent(text="he", token_ids=(1,), index=0))], [lease.request])
    done = JobEvent(text="llo", token_ids=(2,), index=1, finished=Finished(FinishReason.LENGTH, Usage(1, 2)))
    await q.publish([(lease, done)], [lease.request])
    got = [ev async for _id, ev in q.events("a")]
    assert "".join(e.text for e in got) == "hello" and got[-1].terminal
    with direct(primary) as r:  # acked and deleted with the terminal event
        assert r.xpending(stream, WORKER_GROUP)["pending"] == 0 and r.xlen(stream) == 0
    await q.call_off("a")  # a Cancel: on the replica too
    with direct(replica) as r:
        assert r.exists(q.keys.called_off("a"))


async def test_batches_through_sentinel(group: SentinelGroup, queue: RedisQueue) -> None:
    store = RedisBatches(queue.client, queue.keys, retention_s=60, replicas=queue.replicas)
    info, items = batch("s", 3)
    await store.join("cpu")
    made, new = await store.create(info, "fp", items)
    assert new and made.total == 3
    with direct(group.servers[1]) as r:  # the record and every item are on the replica
        assert r.hget(queue.keys.batch("s"), "enqueued") == b"1"
        assert r.xlen(queue.keys.batch_lane("cpu", "s")) == 3
    assert (await store.create(info, "fp", items))[1] is False  # a retry: the stored batch
    leases = await store.lease_items("cpu", "w", 10, 100)
    for lease in leases:
        assert await store.record(lease, ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "t"))
    end = await store.get("s")
    assert end is not None and end.state.value == "completed" and end.succeeded == 3
    got = await store.results("s", "0-0", None)
    assert sorted(r.custom_id for _c, r in got) == ["c0", "c1", "c2"]
    info2, items2 = batch("s2", 2)
    await store.create(info2, "fp", items2)
    cancelled = await store.cancel("s2")
    assert cancelled is not None and cancelled.state.value == "cancelled"


async def test_writes_short_of_replicas_fail_unavailable_and_a_retry_finds_them(group: SentinelGroup) -> None:
    """WAIT 2 with one replica: the submission fails UNAVAILABLE saying so, but it stays on the
    primary; the retry (WAIT 1 now) finds it queued and does not queue it twice."""
    s = settings_of(group, wait_replicas=2, wait_timeout_ms=100)
    strict = RedisQueue.from_settings(s)
    store = RedisBatches(strict.client, strict.keys, retention_s=60, replicas=strict.replicas)
    retry = RedisQueue.from_settings(RedisSettings(url=s.url, prefix=s.prefix, block_ms=200, wait_replicas=1))
    try:
        await strict.join("cpu")
        with pytest.raises(QueueUnavailable, match="the submission reached 1 of the 2 Redis replicas it needs"):
            await strict.submit("cpu", req("x"))
        with pytest.raises(QueueUnavailable, match="the cancel reached 1 of the 2"):
            await strict.call_off("x")
        info, items = batch("w", 2)
        with pytest.raises(QueueUnavailable, match="the batch reached 1 of the 2"):
            await store.create(info, "fp", items)
        await retry.submit("cpu", req("x"))
        leases = await retry.lease("cpu", "w", 10, 100)
        assert [x.request.request_id for x in leases] == ["x"]  # once
    finally:
        await strict.close()
        await retry.close()


async def test_an_items_result_short_of_replicas_is_not_acked_and_a_retry_acks_it(group: SentinelGroup) -> None:
    """WAIT 2 with one replica: recording an item's result fails UNAVAILABLE and the item stays
    leased (its result may not survive a failover, so its ack must not be sent); the retry with WAIT
    1 finds the result recorded, and acks the item without a second result."""
    s = settings_of(group, wait_replicas=2, wait_timeout_ms=100)
    strict = RedisQueue.from_settings(s)
    retry = RedisQueue.from_settings(RedisSettings(url=s.url, prefix=s.prefix, block_ms=200, wait_replicas=1))
    try:
        lenient = RedisBatches(retry.client, retry.keys, retention_s=60, replicas=retry.replicas)
        store = RedisBatches(strict.client, strict.keys, retention_s=60, replicas=strict.replicas)
        info, items = batch("r", 1)
        await lenient.join("cpu")
        await lenient.create(info, "fp", items)
        (lease,) = await store.lease_items("cpu", "w", 10, 100)
        result = ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "t")
        with pytest.raises(QueueUnavailable, match="the item's result reached 1 of the 2 Redis replicas"):
            await store.record(lease, result)
        lane = strict.keys.batch_lane("cpu", "r")
        with direct(group.primary()) as r:
            assert r.xpending(lane, WORKER_GROUP)["pending"] == 1  # not acked
        assert await lenient.record(lease, result) is False  # recorded already: acked now, once
        with direct(group.primary()) as r:
            assert r.xpending(lane, WORKER_GROUP)["pending"] == 0 and r.xlen(lane) == 0
        end = await lenient.get("r")
        assert end is not None and end.state.value == "completed" and end.succeeded == 1
    finally:
        await strict.close()
        await retry.close()


async def test_a_sentinel_that_is_down_is_skipped(group: SentinelGroup) -> None:
    proc = group.sentinel_procs[0]
    assert proc is not None
    proc.kill()
    proc.wait(10)
    q = RedisQueue.from_settings(settings_of(group, wait_replicas=1))  # the first Sentinel it asks is down
    try:
        t0 = time.monotonic()
        await q.join("cpu")
        await q.submit("cpu", req("s"))
        assert time.monotonic() - t0 < 3
    finally:
        await q.close()
        group.start_sentinel(0)


async def test_after_sentinel_failover_every_acknowledged_submission_is_on_the_new_primary(tmp_path: Path) -> None:
    """SENTINEL FAILOVER while submissions flow (WAIT 1, one replica). The old primary stays up,
    and a primary, for about 10 s until Sentinel demotes it: whatever is written there once the
    replica is promoted is lost with it. Every submission the client was told succeeded is on the
    new primary (those after the promotion found no replica: refused); once the Sentinels name the
    new primary the client writes there within PRIMARY_RECHECK_S, never again to the old one."""
    g = SentinelGroup(KIND, tmp_path, replicas=1)
    g.start()
    q = RedisQueue.from_settings(settings_of(g, wait_replicas=1, wait_timeout_ms=200))
    stream = q.keys.jobs("cpu")
    stop = asyncio.Event()
    acknowledged: list[str] = []
    refused: list[str] = []

    async def submitting() -> None:
        n = 0
        while not stop.is_set():
            rid, n = f"j{n}", n + 1
            try:
                await q.submit("cpu", req(rid))
                acknowledged.append(rid)
            except QueueUnavailable as exc:
                refused.append(exc.message)
            await asyncio.sleep(0.01)  # pacing the load, not waiting: about a hundred submissions a second

    task = asyncio.create_task(submitting())
    try:
        await q.join("cpu")
        old = g.primary()
        await until(lambda: len(acknowledged) >= 10, 10, "submissions acknowledged before the failover")
        before = len(acknowledged)
        g.failover()
        new = await asyncio.to_thread(g.wait_failover, old, 0, 20)
        # Time passing on purpose: the pool asks the Sentinels again within PRIMARY_RECHECK_S.
        await asyncio.sleep(PRIMARY_RECHECK_S + 0.5)
        with direct(old) as r_old, direct(new) as r_new:
            assert r_old.info("replication")["role"] == "master"  # not demoted yet: writes there would be lost
            on_old, on_new = r_old.xlen(stream), r_new.xlen(stream)
            await asyncio.sleep(0.5)  # time passing on purpose: half a second of submissions to watch
            assert r_old.xlen(stream) == on_old, "writes went on to the old primary"
            assert r_new.xlen(stream) > on_new  # (applied; refused for want of a replica)
            stop.set()
            await task
            kept = {codec.decode_job(f[JOB_FIELD.encode()]).request_id for _i, f in r_new.xrange(stream)}
        print(f"SENTINEL FAILOVER: {len(acknowledged)} submissions acknowledged, {len(refused)} refused")
        assert before > 0 and refused
        assert all("Redis replicas" in why or why == "the queue is unreachable" for why in refused), refused
        assert set(acknowledged) <= kept, sorted(set(acknowledged) - kept)
    finally:
        stop.set()
        await task
        await q.close()
        g.stop()
