"""Writes the queue may repeat (a retry after a lost reply: the first try was applied), and pooled
connections Redis dropped, against real servers (redis-server and Valkey)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.redisio import is_cluster
from llamamesh.queue.streams import RedisQueue
from llamamesh.types import Attempt, Finished, FinishReason, JobEvent, Usage
from services.relay import Cursor
from tests.queue.jobs import req

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


async def test_a_retried_submission_is_queued_once(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    await q.submit("cpu", req("a"))
    await q.submit("cpu", req("a"))  # the same write again
    await q.submit("cpu", req("b"))
    assert await q.client.xlen(q.keys.jobs("cpu")) == 2
    assert [x.request.request_id for x in await q.lease("cpu", "w", 10, 100)] == ["a", "b"]


async def test_a_retried_attempt_record_is_written_once(redis_queue: RedisQueue) -> None:
    q = redis_queue
    rec = Attempt("a", 0, "cpu", "m", 123, False)
    assert await q.begin("a", rec, first=True)
    assert await q.begin("a", rec, first=True)  # its own retry: done already, not "someone else's"
    assert not await q.begin("a", Attempt("a", 0, "cpu", "m", 456, False), first=True)  # another caller's
    assert await q.attempts("a") == [rec]


async def test_a_publish_repeated_after_a_lost_reply_reaches_the_reader_once(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    await q.submit("cpu", req("r"))
    (lease,) = await q.lease("cpu", "w", 1, 100)
    step = [
        (lease, JobEvent(text="ab", token_ids=(1, 2), index=0)),
        (lease, JobEvent(text="c", token_ids=(3,), index=2)),
    ]
    await q.publish(step, [])
    await q.publish(step, [])  # the outbox's retry of a publish Redis had applied
    end = JobEvent(text="d", token_ids=(4,), index=3, finished=Finished(FinishReason.LENGTH, Usage(1, 4)))
    await q.publish([(lease, end)], [])
    cursor, out = Cursor(), []
    async for _id, ev in q.events("r"):
        assert ev.token_ids == tuple(range(ev.index + 1, ev.index + 1 + len(ev.token_ids)))  # merged only in order
        if (part := cursor.accept(ev)) is not None:
            out.append(part)
    assert cursor.sent == [1, 2, 3, 4]
    assert [i for p in out for i in range(p.index, p.index + len(p.token_ids))] == [0, 1, 2, 3]


async def test_pooled_connections_redis_dropped_are_replaced_not_failed_on(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    await asyncio.gather(*(q.ping() for _ in range(10)))  # ten connections in the pool
    killed = 0
    for url in _urls(q):  # every node of a cluster
        killer = aioredis.Redis.from_url(url)
        try:
            killed += await killer.client_kill_filter(_type="normal", skipme=True)
        finally:
            await killer.aclose()
    assert killed >= 10
    # Every pooled connection is dead now: each command notices before or on use and goes on a fresh one.
    await asyncio.gather(*(q.submit("cpu", req(f"k{i}")) for i in range(10)))
    assert await q.client.xlen(q.keys.jobs("cpu")) == 10


def _urls(q: RedisQueue) -> list[str]:
    if is_cluster(q.client):
        return [f"redis://{n.host}:{n.port}" for n in q.client.get_nodes()]  # type: ignore[attr-defined]
    kw = q.client.connection_pool.connection_kwargs
    return [f"redis://{kw['host']}:{kw['port']}"]


async def test_a_worker_takes_back_its_own_idle_job_unless_it_runs_it(redis_queue: RedisQueue) -> None:
    """A job leased to this worker that it does not run (the lease's reply was lost, or Redis lost
    the job's ack with its last second of writes) is not left pending for ever."""
    q = redis_queue
    await q.join("cpu")
    await q.submit("cpu", req("mine"))
    (lease,) = await q.lease("cpu", "w", 1, 100)
    assert await q.reclaim("cpu", "w", 0, 10, 2, running={lease.entry_id}) == []  # it runs it: kept
    (again,) = await q.reclaim("cpu", "w", 0, 10, 2)
    assert again.request.request_id == "mine" and again.entry_id == lease.entry_id and not again.started
