"""The Redis Streams queue against real servers (redis-server and Valkey), same contract as the fake."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from llamamesh.errors import QueueFull, QueueUnavailable
from llamamesh.queue.keys import CANCEL_AHEAD_TTL_S, WORKER_GROUP, Keys
from llamamesh.queue.memory import MemoryQueue
from llamamesh.queue.protocol import QueueDepth
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import (
    Attempt,
    Failure,
    Finished,
    FinishReason,
    JobEvent,
    Usage,
    WorkerStatus,
)
from tests.queue.conftest import raw_client, reader_blocked, single_server_only
from tests.queue.jobs import req
from tests.waiting import until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


def done(n: int) -> JobEvent:
    return JobEvent(finished=Finished(FinishReason.LENGTH, Usage(1, n)))


@pytest.fixture(params=["redis", "memory"])
async def queue(request: pytest.FixtureRequest, redis_settings: RedisSettings):
    if request.param == "memory":
        yield MemoryQueue()
        return
    q = RedisQueue.from_settings(redis_settings)
    yield q
    await q.close()


async def test_submit_lease_publish_read(queue) -> None:
    await queue.join("cpu")
    await queue.submit("cpu", req("a"))
    leases = await queue.lease("cpu", "w1", 10, 500)
    assert [lease.request for lease in leases] == [req("a")]
    assert not leases[0].cancelled
    lease = leases[0]
    await queue.publish([(lease, JobEvent(text="he", token_ids=(1,), index=0))], [lease.request])
    reader = queue.events("a")
    first_id, first = await anext(reader)
    await reader.aclose()
    assert (first.text, first.token_ids, first.index) == ("he", (1,), 0)
    await queue.publish([(lease, JobEvent(text="llo", token_ids=(2,), index=1)), (lease, done(2))], [lease.request])
    got = [ev async for _id, ev in queue.events("a")]
    assert "".join(e.text for e in got) == "hello"
    assert [t for e in got for t in e.token_ids] == [1, 2]
    assert got[-1].terminal and not any(e.terminal for e in got[:-1])
    # resume from an id gives exactly what follows it
    rest = [e async for _i, e in queue.events("a", after=first_id)]
    assert "".join(e.text for e in rest) == "llo"
    assert rest[0].index == 1 and rest[-1].terminal


async def test_a_reader_behind_gets_queued_events_merged_but_never_a_failure(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    await q.submit("cpu", req("m"))
    (lease,) = await q.lease("cpu", "w1", 1, 500)
    steps = [JobEvent(text=c, token_ids=(i,), index=i) for i, c in enumerate("abc")]
    failed = JobEvent(failed=Failure("internal", "boom"))
    await q.publish([(lease, e) for e in steps], [])
    await q.publish([(lease, failed)], [])
    got = [(i, e) async for i, e in q.events("m")]
    # everything was queued before the read: the three steps as one event, then the failure alone
    assert [e.text for _i, e in got] == ["abc", ""]
    assert got[0][1].token_ids == (0, 1, 2) and got[0][1].index == 0 and not got[0][1].terminal
    assert got[1][1].failed == failed.failed
    # the merged event carries the id of its last entry: resuming after it gives only the failure
    assert [e.failed async for _i, e in q.events("m", after=got[0][0])] == [failed.failed]


async def test_events_block_until_written(queue) -> None:
    await queue.join("cpu")
    await queue.submit("cpu", req("b"))
    (lease,) = await queue.lease("cpu", "w1", 1, 500)
    reader = asyncio.create_task(_collect(queue, "b"))
    await until(lambda: reader_blocked(queue, "xread"), 10, "the reader to block")
    await queue.publish([(lease, JobEvent(text="x", token_ids=(5,)))], [])
    await queue.publish([(lease, done(1))], [])
    got = await asyncio.wait_for(reader, 5)
    assert "".join(e.text for e in got) == "x" and got[-1].terminal  # the two may come merged


async def _collect(queue, rid: str) -> list[JobEvent]:
    return [ev async for _i, ev in queue.events(rid)]


async def test_cancel_is_seen_at_lease_and_publish(queue) -> None:
    await queue.join("cpu")
    await queue.submit("cpu", req("c1"))
    await queue.submit("cpu", req("c2"))
    await queue.cancel("c1")
    leases = await queue.lease("cpu", "w1", 10, 500)
    assert {lease.request.request_id: lease.cancelled for lease in leases} == {"c1": True, "c2": False}
    assert await queue.publish([], [req("c2")]) == set()
    await queue.cancel("c2")
    assert await queue.publish([], [req("c2")]) == {"c2"}


async def test_the_callers_cancel_reaches_every_attempt(queue) -> None:
    await queue.join("cpu")
    first, later = req("r"), dataclasses.replace(req("r.1"), origin_id="r")
    await queue.submit("cpu", later)
    assert await queue.publish([], [first, later]) == set()
    await queue.call_off("r")  # the Cancel RPC names the caller's id
    assert await queue.publish([], [first, later]) == {"r", "r.1"}
    assert [x.cancelled for x in await queue.lease("cpu", "w1", 10, 500)] == [True]


async def test_a_cancel_of_an_unused_id_holds_briefly_and_one_of_an_ended_request_not_past_it(
    redis_settings: RedisSettings,
) -> None:
    """A Cancel that overtook its Generate cancels it (its flag lives CANCEL_AHEAD_TTL_S, then as long
    as the request); one of an earlier request under the same id does not cancel a new one."""
    q = RedisQueue.from_settings(redis_settings)
    r = raw_client(redis_settings)
    try:
        attempt = Attempt("ahead", 0, "cpu", "m", 1)
        await q.call_off("ahead")
        assert 0 < await r.ttl(q.keys.called_off("ahead")) <= CANCEL_AHEAD_TTL_S
        assert await q.begin("ahead", attempt, first=True)
        assert await r.ttl(q.keys.called_off("ahead")) > CANCEL_AHEAD_TTL_S  # held while the request lives
        assert await q.publish([], [req("ahead")]) == {"ahead"}
        # The record of the request ends (its TTL runs out); the flag of the old Cancel is left over.
        await r.delete(q.keys.attempts("ahead"))
        assert await r.exists(q.keys.called_off("ahead"))
        assert await q.begin("ahead", dataclasses.replace(attempt, fingerprint="new"), first=True)
        assert not await r.exists(q.keys.called_off("ahead"))  # a new request under the id runs
        assert await q.publish([], [req("ahead")]) == set()
    finally:
        await r.aclose()
        await q.close()


async def test_a_bounded_submit_refuses_past_the_waiting_limit(queue) -> None:
    await queue.join("cpu")
    for i in range(3):
        await queue.submit("cpu", req(f"q{i}"), max_waiting=3)
    with pytest.raises(QueueFull):
        await queue.submit("cpu", req("q3"), max_waiting=3)
    assert len(await queue.lease("cpu", "w1", 2, 500)) == 2  # leased jobs no longer wait
    await queue.submit("cpu", req("q3"), max_waiting=3)
    await queue.submit("cpu", req("q4"), max_waiting=3)
    with pytest.raises(QueueFull):
        await queue.submit("cpu", req("q5"), max_waiting=3)


async def test_lease_respects_count_and_each_job_goes_to_one_consumer(queue) -> None:
    await queue.join("cpu")
    for i in range(5):
        await queue.submit("cpu", req(f"j{i}"))
    first = await queue.lease("cpu", "w1", 3, 500)
    second = await queue.lease("cpu", "w2", 10, 500)
    assert len(first) == 3 and len(second) == 2
    assert {x.request.request_id for x in first}.isdisjoint({x.request.request_id for x in second})
    assert await queue.lease("cpu", "w3", 10, 50) == []


async def test_terminal_event_acks_expires_and_deletes(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(redis_settings)
    r = raw_client(redis_settings)
    keys = Keys(redis_settings.prefix)
    try:
        await q.join("cpu")
        await q.submit("cpu", req("t"))
        (lease,) = await q.lease("cpu", "w1", 1, 500)
        assert (await r.xpending(keys.jobs("cpu"), WORKER_GROUP))["pending"] == 1
        await q.publish([(lease, JobEvent(text="a", token_ids=(1,)))], [])
        assert 0 < await r.ttl(keys.events("t")) <= redis_settings.event_idle_ttl_s
        await q.publish([(lease, done(1))], [])
        assert (await r.xpending(keys.jobs("cpu"), WORKER_GROUP))["pending"] == 0
        assert await r.xlen(keys.jobs("cpu")) == 0
        assert 0 < await r.ttl(keys.events("t")) <= redis_settings.event_ttl_s
    finally:
        await r.aclose()
        await q.close()


async def command_calls(r: Any) -> dict[str, int]:
    """Calls per command name since the server started (INFO commandstats)."""
    stats = await r.info("commandstats")
    return {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}


async def test_publish_sends_one_pipeline_of_known_size(redis_settings: RedisSettings) -> None:
    """Events of many requests in one step go out in one pipeline on one connection."""
    single_server_only(redis_settings, "counts one server's commands (a cluster splits the pipeline per master)")
    q = RedisQueue.from_settings(redis_settings)
    r = raw_client(redis_settings)
    try:
        await q.join("cpu")
        for i in range(20):
            await q.submit("cpu", req(f"s{i}"))
        leases = await q.lease("cpu", "w1", 20, 500)
        info_before = (await r.info("clients"))["connected_clients"]
        calls_before = await command_calls(r)
        before = (await r.info("stats"))["total_commands_processed"]
        await q.publish([(lease, JobEvent(text="z", token_ids=(1,))) for lease in leases], [x.request for x in leases])
        after = (await r.info("stats"))["total_commands_processed"]
        calls = await command_calls(r)
        sent = {cmd: n - calls_before.get(cmd, 0) for cmd, n in calls.items() if n != calls_before.get(cmd, 0)}
        # One EVAL running 20 XADD + 20 EXPIRE (first events; Redis counts a script's commands
        # too), one MGET of the 2 x 20 cancel flags (the job's and its caller's; watched at most
        # every 100 ms), + 1 for the INFO call itself
        assert after - before == 43
        # What came over the wire: the EVAL and the MGET (and INFO calls), no command per request.
        assert {cmd: n for cmd, n in sent.items() if cmd not in ("info",)} == {
            "eval": 1,
            "xadd": 20,
            "expire": 20,
            "mget": 1,
        }
        before = (await r.info("stats"))["total_commands_processed"]
        await q.publish([(lease, JobEvent(text="y", token_ids=(2,), index=1)) for lease in leases], [])
        after = (await r.info("stats"))["total_commands_processed"]
        assert after - before == 22  # later events: the EVAL and its XADDs only
        assert (await r.info("clients"))["connected_clients"] == info_before
    finally:
        await r.aclose()
        await q.close()


async def test_missing_group_is_recreated(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(redis_settings)
    r = raw_client(redis_settings)
    try:
        await q.join("cpu")
        await r.delete(Keys(redis_settings.prefix).jobs("cpu"))
        assert await q.lease("cpu", "w1", 1, 50) == []
        await q.submit("cpu", req("after"))
        (lease,) = await q.lease("cpu", "w1", 1, 500)
        assert lease.request.request_id == "after"
    finally:
        await r.aclose()
        await q.close()


async def test_unreachable_redis_is_queue_unavailable() -> None:
    from tests.redisproc import free_port

    q = RedisQueue.from_settings(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        with pytest.raises(QueueUnavailable):
            await q.submit("cpu", req("x"))
        with pytest.raises(QueueUnavailable):
            await q.ping()
    finally:
        await q.close()


async def test_a_burst_past_the_connection_bound_waits_for_connections_instead_of_failing(
    redis_settings: RedisSettings,
) -> None:
    """256 submissions at once through a client bounded to 16 connections all go through, on at
    most 16 connections (redis-py's default pool refused past 100: UNAVAILABLE for a burst of new
    calls on one gateway process)."""
    single_server_only(redis_settings, "counts one server's clients")
    q = RedisQueue.from_settings(dataclasses.replace(redis_settings, max_connections=16))
    raw = raw_client(redis_settings)
    try:
        before = len(await raw.client_list())
        await asyncio.gather(*(q.submit("cpu", req(f"burst-{i}")) for i in range(256)))
        assert len(await raw.client_list()) - before <= 16
        leases = await q.lease("cpu", "w1", 300, 100)
        assert sorted(lease.request.request_id for lease in leases) == sorted(f"burst-{i}" for i in range(256))
    finally:
        await q.close()
        await raw.aclose()


def test_a_connection_bound_below_eight_is_refused_naming_the_setting() -> None:
    from llamamesh.queue.redisio import connect

    with pytest.raises(ValueError, match="LLAMAMESH_REDIS_MAX_CONNECTIONS"):
        connect(RedisSettings(url="redis://127.0.0.1:1/0", max_connections=4))


@pytest.fixture
async def rq(redis_settings: RedisSettings):
    q = RedisQueue.from_settings(redis_settings)
    yield q
    await q.close()


async def test_racing_reclaimers_take_each_stale_job_once(rq: RedisQueue) -> None:
    await rq.join("cpu")
    for i in range(50):
        await rq.submit("cpu", req(f"s{i}"))
    assert len(await rq.lease("cpu", "dead", 50, 500)) == 50
    await asyncio.sleep(1.1)  # time passing on purpose: the entries age past the idle time under test
    # A second's idle time: a reclaimer that comes later than that after the first one claimed
    # takes the job again, as it should (CI's loaded cluster run took longer than 200 ms).
    got = await asyncio.gather(*(rq.reclaim("cpu", f"r{k}", 1000, 50, max_deliveries=3) for k in range(4)))
    ids = [x.request.request_id for leases in got for x in leases]
    assert sorted(ids) == sorted(f"s{i}" for i in range(50))  # all of them, none twice


async def test_touched_jobs_are_not_reclaimed_and_own_jobs_come_back_on_restart(rq: RedisQueue) -> None:
    await rq.join("cpu")
    await rq.submit("cpu", req("busy"))
    await rq.submit("cpu", req("orphan"))
    leases = {x.request.request_id: x for x in await rq.lease("cpu", "w1", 2, 500)}
    await asyncio.sleep(0.3)  # time passing on purpose: both entries age past the 200 ms idle time
    # w1's heartbeat says it still runs busy
    await rq.heartbeat(WorkerStatus(worker="w1", pool="cpu"), 1.0, touch=[leases["busy"].entry_id])
    assert [x.request.request_id for x in await rq.reclaim("cpu", "w2", 200, 10, 3)] == ["orphan"]
    # w1 restarts under its name: what it still holds (busy) comes back to it at once
    assert [x.request.request_id for x in await rq.reclaim("cpu", "w1", 0, 10, 3, own=True)] == ["busy"]


async def test_a_reclaimed_job_says_whether_its_dead_worker_had_begun_it(rq: RedisQueue) -> None:
    await rq.join("cpu")
    await rq.submit("cpu", req("begun"))
    await rq.submit("cpu", req("untouched"))
    leases = {x.request.request_id: x for x in await rq.lease("cpu", "w1", 2, 500)}
    assert not any(x.started for x in leases.values())  # a first lease never is
    await rq.publish([(leases["begun"], JobEvent(text="a", token_ids=(1,), index=0))], [])
    await asyncio.sleep(0.3)  # time passing on purpose: both entries age past the 200 ms idle time
    got = {x.request.request_id: x for x in await rq.reclaim("cpu", "w2", 200, 10, 3)}
    assert {k: x.started for k, x in got.items()} == {"begun": True, "untouched": False}
    assert got["begun"].begun == (JobEvent(text="a", token_ids=(1,), index=0),) and got["untouched"].begun == ()


async def test_a_streams_last_event_is_read_alone_with_its_count(rq: RedisQueue) -> None:
    await rq.join("cpu")
    await rq.submit("cpu", req("r"))
    (lease,) = await rq.lease("cpu", "w1", 1, 500)
    assert await rq.last_event("r") == (0, None)
    evs = [JobEvent(text="a", token_ids=(1,), index=0, worker="w1"), JobEvent(text="b", token_ids=(2,), index=1)]
    for ev in evs:
        await rq.publish([(lease, ev)], [])
    assert await rq.last_event("r") == (2, evs[1])


async def test_a_job_that_keeps_killing_workers_is_dead_lettered(rq: RedisQueue, redis_settings: RedisSettings) -> None:
    await rq.join("cpu")
    await rq.submit("cpu", req("poison"))
    assert len(await rq.lease("cpu", "w1", 1, 500)) == 1  # delivery 1: w1 dies
    await asyncio.sleep(0.25)  # time passing on purpose: the entry ages past the 200 ms idle time
    assert len(await rq.reclaim("cpu", "w2", 200, 10, max_deliveries=2)) == 1  # delivery 2: w2 dies
    await asyncio.sleep(0.25)  # and again
    assert await rq.reclaim("cpu", "w3", 200, 10, max_deliveries=2) == []  # a third would be one too many
    evs = [e async for _i, e in rq.events("poison")]
    assert evs[-1].failed is not None and "set aside" in evs[-1].failed.message
    r = raw_client(redis_settings)
    try:
        keys = Keys(redis_settings.prefix)
        dead = await r.xrange(keys.dead_letters("cpu"))
        assert len(dead) == 1 and dead[0][1][b"deliveries"] == b"3"
        assert dead[0][1][b"reason"] == b"the 2 workers that took it died"
        assert (await r.xpending(keys.jobs("cpu"), WORKER_GROUP))["pending"] == 0
        assert await r.xlen(keys.jobs("cpu")) == 0
    finally:
        await r.aclose()


async def test_a_cancelled_job_past_its_deliveries_comes_back_to_be_skipped(rq: RedisQueue) -> None:
    """Its gateway moved it on or set it aside itself: no second dead letter, the worker skips it."""
    await rq.join("cpu")
    await rq.submit("cpu", req("poison"))
    assert len(await rq.lease("cpu", "w1", 1, 500)) == 1
    await asyncio.sleep(0.25)  # time passing on purpose: the entry ages past the 200 ms idle time
    assert len(await rq.reclaim("cpu", "w2", 200, 10, max_deliveries=1)) == 0  # (a poison job, were it not)
    await rq.submit("cpu", req("cancelled"))
    assert len(await rq.lease("cpu", "w1", 1, 500)) == 1
    await rq.cancel("cancelled")
    await asyncio.sleep(0.25)  # and again
    (lease,) = await rq.reclaim("cpu", "w3", 200, 10, max_deliveries=1)
    assert lease.request.request_id == "cancelled" and lease.cancelled


async def test_queue_depth_counts_waiting_and_leased_jobs_of_every_tenant(queue) -> None:
    assert await queue.queue_depth("cpu") == QueueDepth(0, 0)  # no stream yet
    await queue.join("cpu")
    for i in range(3):
        await queue.submit("cpu", req(f"a{i}"))
    for i in range(2):
        await queue.submit("cpu", dataclasses.replace(req(f"b{i}"), tenant="b"))
    leased = await queue.lease("cpu", "w-1", 2, 0)
    assert len(leased) == 2
    assert await queue.queue_depth("cpu") == QueueDepth(3, 2)
    await queue.publish([(leased[0], done(1))], [])  # its end acks it
    assert await queue.queue_depth("cpu") == QueueDepth(3, 1)
    assert await queue.queue_depth("gpu") == QueueDepth(0, 0)
