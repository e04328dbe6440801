"""The worker against a real Redis, with the fake engine: admission, coalescing, cancel, ack."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import BatchSettings, RedisSettings, WorkerSettings
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, JobEvent, SamplingParams
from tests.queue.jobs import batch
from tests.waiting import until
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


class Running:
    def __init__(self, worker: Worker, engine: FakeEngine, queue: RedisQueue, settings: RedisSettings) -> None:
        self.worker, self.engine, self.queue, self.settings = worker, engine, queue, settings


@pytest.fixture
async def running(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[Running]:
    step, inflight = getattr(request, "param", (0.0, 4))
    ws = WorkerSettings(pool="cpu", engine="fake", max_inflight=inflight, fake_step_s=step, consumer="w-test")
    worker, engine, queue, stop, task = await _start_worker(redis_settings, ws)
    try:
        yield Running(worker, engine, queue, redis_settings)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await engine.shutdown()
        await queue.close()


def req(rid: str, n: int = 8) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt=f"prompt {rid}", sampling=SamplingParams(max_tokens=n))


async def events(q: RedisQueue, rid: str) -> list[JobEvent]:
    return [e async for _i, e in q.events(rid)]


def completed(b: BatchInfo | None) -> bool:
    return b is not None and b.state is BatchState.COMPLETED


async def pending(settings: RedisSettings) -> int:
    r = aioredis.Redis.from_url(settings.url)
    try:
        return int((await r.xpending(Keys(settings.prefix).jobs("cpu"), WORKER_GROUP))["pending"])
    finally:
        await r.aclose()


async def test_many_requests_in_flight_and_acked(running: Running) -> None:
    q = running.queue
    for i in range(12):
        await q.submit("cpu", req(f"r{i}"))
    results = await asyncio.gather(*(events(q, f"r{i}") for i in range(12)))
    for evs in results:
        assert sum(len(e.token_ids) for e in evs) == 8
        assert evs[-1].finished is not None
    assert await pending(running.settings) == 0
    assert running.worker.inflight == 0


@pytest.mark.parametrize("running", [(0.02, 8)], indirect=True)
async def test_deltas_are_coalesced_per_step(running: Running) -> None:
    """8 concurrent requests x 10 tokens: far fewer publishes than tokens."""
    q = running.queue
    for i in range(8):
        await q.submit("cpu", req(f"k{i}", n=10))
    before = running.worker.outbox.publishes
    await asyncio.gather(*(events(q, f"k{i}") for i in range(8)))
    publishes = running.worker.outbox.publishes - before
    assert publishes <= 30, publishes  # 80 tokens; ~11 steps (+ periodic cancel checks)


@pytest.mark.parametrize("running", [(0.05, 4)], indirect=True)
async def test_cancel_mid_stream_aborts_and_acks(running: Running) -> None:
    q = running.queue
    await q.submit("cpu", req("x", n=400))
    seen = 0
    async for _i, ev in q.events("x"):
        seen += len(ev.token_ids)
        if seen >= 2:
            break
    await q.cancel("x")
    evs = await asyncio.wait_for(events(q, "x"), 5)
    assert evs[-1].finished is not None
    assert evs[-1].finished.finish_reason.value == "cancelled"
    assert "x" in running.engine.aborted
    assert await pending(running.settings) == 0


async def test_job_cancelled_before_lease_is_skipped(redis_settings: RedisSettings) -> None:
    ws = WorkerSettings(pool="cpu", engine="fake", max_inflight=2, consumer="w-skip")
    queue = RedisQueue.from_settings(redis_settings)
    engine = FakeEngine(ws)
    await queue.join("cpu")
    await queue.submit("cpu", req("early"))
    await queue.cancel("early")
    worker = Worker(ws, queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        evs = await asyncio.wait_for(events(queue, "early"), 5)
        assert evs[-1].finished is not None and evs[-1].finished.finish_reason.value == "cancelled"
        assert engine.served == []
        assert await pending(redis_settings) == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await queue.close()


async def test_worker_waits_for_redis_instead_of_exiting() -> None:
    from tests.redisproc import free_port

    ws = WorkerSettings(pool="cpu", engine="fake", consumer="w-wait")
    queue = RedisQueue.from_settings(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    worker = Worker(ws, queue, FakeEngine(ws), block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await until(lambda: worker.join_failures >= 2, 10, "two failed joins")
        assert not task.done() and not worker.ready.is_set()
        stop.set()
        await asyncio.wait_for(task, 5)
    finally:
        await queue.close()


async def test_heartbeat_lasts_through_the_drain_and_is_withdrawn_after(redis_settings: RedisSettings) -> None:
    ws = WorkerSettings(
        pool="cpu",
        engine="fake",
        max_inflight=4,
        fake_step_s=0.02,
        consumer="w-beat",
        heartbeat_s=0.05,
        heartbeat_ttl_s=0.5,
        grace_s=10,
    )
    queue = RedisQueue.from_settings(redis_settings)
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        await queue.submit("cpu", req("beat", n=100))  # 100 steps of 20 ms: still running at the stop
        reader = queue.events("beat")
        _id, first = await anext(reader)
        await reader.aclose()
        assert first.worker == "w-beat"
        status = await queue.workers("cpu")
        assert [s.worker for s in status] == ["w-beat"] and status[0].max_inflight == 4
        stop.set()
        # draining: the job finishes, and the heartbeat (TTL 0.5 s) is kept fresh meanwhile (a read
        # that returns while the job still runs was made before the drain ended, so before the leave)
        checked = 0
        while worker.inflight:
            seen = [s.worker for s in await queue.workers("cpu")]
            if worker.inflight:
                assert seen == ["w-beat"]
                checked += 1
            await asyncio.wait({task}, timeout=0.1)
        assert checked >= 10  # the job ran on for most of its 2 s after the stop: several TTLs
        await task
        evs = await events(queue, "beat")
        assert evs[-1].finished is not None and evs[-1].finished.finish_reason.value == "length"
        assert await queue.workers("cpu") == []  # withdrawn once drained
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await engine.shutdown()
        await queue.close()


async def test_leases_at_most_lease_batch_jobs_per_read(redis_settings: RedisSettings) -> None:
    """A burst is read in slices of lease_batch, so other workers of the pool get their share of it."""
    counts: list[int] = []

    class Counting(RedisQueue):
        async def lease(self, pool: str, consumer: str, count: int, block_ms: int, exclude=()):  # type: ignore[no-untyped-def]
            got = await super().lease(pool, consumer, count, block_ms, exclude)
            if got:
                counts.append(count)
                assert len(got) <= count
            return got

    ws = WorkerSettings(pool="cpu", engine="fake", max_inflight=8, lease_batch=3, consumer="w-batch")
    queue = Counting.from_settings(redis_settings)
    for i in range(8):
        await queue.submit("cpu", req(f"b{i}", n=4))
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        results = await asyncio.gather(*(events(queue, f"b{i}") for i in range(8)))
        assert all(evs[-1].finished is not None for evs in results)
        assert counts and max(counts) == 3, counts
        assert len(counts) >= 3  # 8 jobs in slices of at most 3
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await engine.shutdown()
        await queue.close()


@pytest.mark.parametrize("running", [(0.05, 4)], indirect=True)
async def test_the_worker_aborts_a_job_at_its_deadline_and_frees_the_slot(running: Running) -> None:
    """No gateway cancels it (as when the gateway died): the worker itself stops at the deadline."""
    q = running.queue
    late = dataclasses.replace(req("dl", n=400), deadline_unix_ns=time.time_ns() + 300_000_000)
    await q.submit("cpu", late)
    evs = await asyncio.wait_for(events(q, "dl"), 5)
    assert evs[-1].failed is not None and evs[-1].failed.code == "deadline_exceeded", evs[-1]
    assert 0 < sum(len(e.token_ids) for e in evs) < 400
    assert "dl" in running.engine.aborted
    assert await pending(running.settings) == 0 and running.worker.inflight == 0


async def test_a_job_whose_deadline_passed_in_the_queue_never_runs(running: Running) -> None:
    q = running.queue
    await q.submit("cpu", dataclasses.replace(req("gone"), deadline_unix_ns=time.time_ns() - 1))
    evs = await asyncio.wait_for(events(q, "gone"), 5)
    assert evs[-1].failed is not None and evs[-1].failed.code == "deadline_exceeded"
    assert [e for e in evs if e.token_ids] == [] and "gone" not in running.engine.served
    assert await pending(running.settings) == 0


Started = tuple[Worker, FakeEngine, RedisQueue, asyncio.Event, "asyncio.Task[None]"]


async def _start_worker(settings: RedisSettings, ws: WorkerSettings, kind: type[RedisQueue] = RedisQueue) -> Started:
    queue = kind.from_settings(settings)
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(worker.ready.wait(), 5)
    return worker, engine, queue, stop, task


async def test_a_dead_workers_job_is_taken_over_and_a_long_healthy_one_never_is(redis_settings: RedisSettings) -> None:
    """Two workers reclaim every 0.25 s (claim idle 0.5 s). A job leased by a consumer that died
    is finished by one of them; a job running 3 x longer than the claim idle time runs once."""
    queue = RedisQueue.from_settings(redis_settings)
    await queue.join("cpu")
    await queue.submit("cpu", req("orphan", n=4))
    assert len(await queue.lease("cpu", "ghost", 1, 500)) == 1  # ghost dies holding it
    ws = [
        WorkerSettings(
            pool="cpu",
            engine="fake",
            max_inflight=4,
            fake_step_s=0.05,
            consumer=f"w{i}",
            claim_idle_s=0.5,
            heartbeat_s=0.1,
        )
        for i in range(2)
    ]
    started = [await _start_worker(redis_settings, s) for s in ws]
    try:
        orphan = await asyncio.wait_for(events(queue, "orphan"), 10)
        assert sum(len(e.token_ids) for e in orphan) == 4 and orphan[-1].finished is not None
        await queue.submit("cpu", req("long", n=30))  # 30 steps of 50 ms: 1.5 s = 3 x claim idle
        long = await asyncio.wait_for(events(queue, "long"), 10)
        assert sum(len(e.token_ids) for e in long) == 30 and long[-1].finished is not None
        served = [rid for _w, engine, *_ in started for rid in engine.served]
        assert served.count("long") == 1 and served.count("orphan") == 1, served
        assert await pending(redis_settings) == 0
    finally:
        for _worker, engine, q, stop, task in started:
            stop.set()
            await asyncio.wait_for(task, 10)
            await engine.shutdown()
            await q.close()
        await queue.close()


class HeadroomPolls(RedisQueue):
    """Counts the worker's non-blocking looks at the other tenants' streams (a lease that excludes some)."""

    polls = 0
    _more: asyncio.Event | None = None

    async def lease(self, pool: str, consumer: str, count: int, block_ms: int, exclude=()):  # type: ignore[no-untyped-def]
        got = await super().lease(pool, consumer, count, block_ms, exclude)
        if exclude:
            self.polls += 1
            if self._more is not None:
                self._more.set()
        return got

    async def polled(self, n: int) -> None:
        """Until ``n`` more polls than now (bounded: each takes a headroom_poll_s)."""
        target = self.polls + n
        self._more = asyncio.Event()
        await until(lambda: self.polls >= target, 5 * n, f"{n} headroom polls", wake=self._more)


async def test_a_tenant_behind_anothers_backlog_starts_in_the_headroom_at_once(redis_settings: RedisSettings) -> None:
    """Tenant A's backlog holds every slot but the headroom; tenant B's job takes that slot at once,
    long before any of A's ends, and A never takes it."""
    ws = WorkerSettings(
        pool="cpu", engine="fake", max_inflight=4, fake_step_s=0.05, consumer="w-headroom", tenant_headroom=1
    )
    worker, engine, queue, stop, task = await _start_worker(redis_settings, ws, HeadroomPolls)
    assert isinstance(queue, HeadroomPolls)
    try:
        backlog = [dataclasses.replace(req(f"a{i}", n=40), request_id=f"acme/a{i}", tenant="acme") for i in range(8)]
        for r in backlog:
            await queue.submit("cpu", r)
        await until(lambda: len(worker.jobs.running) >= 3, 5, "the worker to admit three of A's jobs")
        await queue.polled(3)  # several headroom polls: A still holds 3 of 4
        assert len(worker.jobs.running) == 3
        t0 = time.monotonic()
        await queue.submit("cpu", dataclasses.replace(req("b0", n=2), request_id="beta/b0", tenant="beta"))
        got = await asyncio.wait_for(events(queue, "beta/b0"), 5)
        assert got[-1].finished is not None
        assert time.monotonic() - t0 < 1.0  # an A job takes 2 s: B did not wait for one to end
        assert not any(ev.terminal for _i, ev in await queue.read_events("acme/a0"))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await engine.shutdown()
        await queue.close()


async def test_a_batch_item_its_own_worker_claims_back_stays_leased(redis_settings: RedisSettings) -> None:
    """The worker's touches missed (Redis was out past the claim idle time; here: a heartbeat slower
    than the claim idle time), so its own reclaim takes back the item it is running. That is no second
    copy to drop: the entry stays leased, and when the worker stops before the item ends, the next
    worker finds it and records its one result."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.3)
    stream = q.keys.batch_lane("cpu", "own")
    info, items = batch("own", 1, max_tokens=400)
    claims = BatchSettings(claim_idle_s=0.3, max_share=1.0)
    ws = WorkerSettings(
        pool="cpu",
        engine="fake",
        max_inflight=2,
        fake_step_s=0.05,
        consumer="w-self",
        heartbeat_s=30,
        heartbeat_ttl_s=90,
        grace_s=0.1,
    )
    engine = FakeEngine(ws)
    worker = Worker(ws, q, engine, block_ms=100, batches=store, batch=claims)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    async def delivered() -> int:
        rows = await q.client.xpending_range(stream, WORKER_GROUP, "-", "+", 10)
        return int(rows[0]["times_delivered"]) if rows else 0

    try:
        await store.create(info, "fp", items)

        async def claimed_back_twice() -> bool:
            assert await q.client.xlen(stream) == 1, "the running item's entry was dropped"
            return await delivered() >= 3

        # Claimed back by itself twice over (every claim_idle_s / 2), while it runs (20 s of tokens).
        await until(claimed_back_twice, 10, "the worker to claim its own item back twice", poll_s=0.05)
        assert worker.inflight == 1 and await q.client.xlen(stream) == 1
        stop.set()  # the item is aborted unfinished: it records nothing and stays leased
        await asyncio.wait_for(task, 10)
        assert (await q.client.xpending(stream, WORKER_GROUP))["pending"] == 1
        b = await store.get("own")
        assert b is not None and b.succeeded == 0
        # The next worker takes it over and records it.
        heir_ws = dataclasses.replace(ws, consumer="w-heir", fake_step_s=0.0, heartbeat_s=0.1, heartbeat_ttl_s=1.0)
        heir = Worker(heir_ws, q, FakeEngine(heir_ws), block_ms=100, batches=store, batch=claims)
        stop2 = asyncio.Event()
        task = asyncio.create_task(heir.run(stop2))
        b = await until(lambda: store.get("own"), 10, "the heir to complete the batch", done=completed, poll_s=0.05)
        # Acked and deleted just after its result.
        await until(lambda: q.client.xlen(stream), 10, "the item's entry to leave the stream", done=lambda n: n == 0)
        assert b.succeeded == 1 and len(await store.results("own", "0-0", None)) == 1
        stop2.set()
        await asyncio.wait_for(task, 10)
    finally:
        stop.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await q.close()


async def test_a_second_copy_that_cannot_be_dropped_while_redis_is_out_does_not_stop_the_worker(
    redis_settings: RedisSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item queued twice: the worker runs the first copy and drops the second; when the drop fails
    (Redis out), the worker goes on, and the second copy, left leased, is claimed again later and
    dropped as the duplicate it is: one result, nothing left in the stream."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.3)
    stream = q.keys.batch_lane("cpu", "twice")
    info, items = batch("twice", 1, max_tokens=20)
    discard = store.discard
    refused: list[str] = []

    async def out_once(lease: Any) -> None:
        if not refused:
            refused.append(lease.entry_id)
            raise QueueUnavailable("the queue is unreachable")
        await discard(lease)

    monkeypatch.setattr(store, "discard", out_once)
    ws = WorkerSettings(
        pool="cpu",
        engine="fake",
        max_inflight=4,
        fake_step_s=0.02,
        consumer="w-twice",
        heartbeat_s=0.1,
        heartbeat_ttl_s=1.0,
    )
    await store.create(info, "fp", items * 2)  # the same item twice in the stream
    # Static admission: both copies start at once (adaptive would start one, at its floor, first).
    admission = BatchSettings(claim_idle_s=0.3, max_share=1.0, admission="static")
    worker = Worker(ws, q, FakeEngine(ws), block_ms=100, batches=store, batch=admission)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:

        async def batch_if_running() -> BatchInfo | None:
            assert not task.done(), task
            return await store.get("twice")

        async def stream_length() -> int:
            assert not task.done(), task
            return int(await q.client.xlen(stream))

        b = await until(batch_if_running, 10, "the batch to complete", done=completed, poll_s=0.05)
        # The second copy: claimed again after 0.3 s, then dropped.
        await until(stream_length, 10, "the second copy to leave the stream", done=lambda n: n == 0, poll_s=0.05)
        assert refused and b.succeeded == 1 and len(await store.results("twice", "0-0", None)) == 1
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await q.close()
