"""A worker's life as its heartbeat tells it, against a real Redis: starting (with what the engine is
doing) before ready, failed (with the reason) when the engine cannot start, and the watchdog that
ends a worker whose engine died or wedged."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest
from structlog.testing import capture_logs

from llamamesh.errors import EngineDead, QueueUnavailable
from llamamesh.queue.memory import MemoryBatches, MemoryQueue
from llamamesh.queue.protocol import Lease
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings, WorkerSettings
from llamamesh.types import GenerationRequest, ItemResult, JobEvent, SamplingParams, WorkerStatus
from tests.queue.jobs import batch
from tests.waiting import until
from workers.engines.fake import FakeEngine
from workers.worker import FAILED_TTL_S, Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


class SlowStart(FakeEngine):
    """A fake engine whose start goes through named steps, each held until the test lets it go."""

    def __init__(self, settings: WorkerSettings, fail: str = "") -> None:
        super().__init__(settings)
        self.step = asyncio.Event()
        self.fail = fail
        self._doing = ""

    @property
    def starting(self) -> str:
        return self._doing

    async def start(self) -> None:
        for what in ("converting the model", "loading the model"):
            self._doing = what
            await self.step.wait()
            self.step.clear()
        self._doing = ""
        if self.fail:
            raise EngineDead(self.fail)
        await super().start()


async def status_of(queue: RedisQueue, name: str) -> WorkerStatus | None:
    return next((w for w in await queue.workers("cpu") if w.worker == name), None)


def running(
    ws: WorkerSettings,
    queue: RedisQueue,
    engine: FakeEngine,
    stop: asyncio.Event | None = None,
) -> tuple[Worker, asyncio.Task[None]]:
    """A worker over ``engine``, running (its engine not started: the worker starts it)."""
    worker = Worker(ws, queue, engine, block_ms=100)
    return worker, asyncio.create_task(worker.run(stop or asyncio.Event()))


Events = AsyncGenerator[tuple[str, JobEvent], None]


async def streaming(worker: Worker, queue: RedisQueue, rid: str) -> tuple[Events, JobEvent]:
    """Once ``worker`` is ready, a long request ``rid`` submitted and its first event read: its events
    (to read on) and that first one."""
    await asyncio.wait_for(worker.ready.wait(), 5)
    await queue.submit("cpu", GenerationRequest(rid, "m", prompt="x", sampling=SamplingParams(max_tokens=500)))
    events = queue.events(rid)
    async for _i, ev in events:
        return events, ev
    raise AssertionError(f"{rid}: no event")


def settings(name: str, **kw: object) -> WorkerSettings:
    return WorkerSettings(pool="cpu", engine="fake", consumer=name, heartbeat_s=0.05, heartbeat_ttl_s=1.0, **kw)  # type: ignore[arg-type]


async def test_the_heartbeat_says_starting_and_what_the_engine_does_then_ready(redis_settings: RedisSettings) -> None:
    ws = settings("w-slow")
    queue = RedisQueue.from_settings(redis_settings)
    engine = SlowStart(ws)
    stop = asyncio.Event()
    worker, task = running(ws, queue, engine, stop)
    try:
        await until(lambda: _is(queue, "w-slow", "starting", "converting the model"), 10, "w-slow converting the model")
        first = await status_of(queue, "w-slow")
        assert first is not None and first.since_unix_s > 0 and not first.ready
        engine.step.set()
        await until(lambda: _is(queue, "w-slow", "starting", "loading the model"), 10, "w-slow loading the model")
        second = await status_of(queue, "w-slow")
        assert second is not None and second.since_unix_s >= first.since_unix_s
        assert not worker.ready.is_set()
        engine.step.set()
        await asyncio.wait_for(worker.ready.wait(), 5)
        await until(lambda: _is(queue, "w-slow", "ready", ""), 10, "w-slow ready")
        await queue.submit("cpu", GenerationRequest("r1", "m", prompt="hi", sampling=SamplingParams(max_tokens=3)))
        evs = [e async for _i, e in queue.events("r1")]
        assert evs[-1].finished is not None
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await queue.close()


async def _is(queue: RedisQueue, name: str, state: str, detail: str) -> bool:
    s = await status_of(queue, name)
    return s is not None and s.state == state and s.detail == detail


async def test_an_engine_that_cannot_start_is_reported_failed_with_its_reason(redis_settings: RedisSettings) -> None:
    ws = settings("w-fail")
    queue = RedisQueue.from_settings(redis_settings)
    engine = SlowStart(ws, fail="cannot load model /nope.gguf: FileNotFoundError")
    worker, task = running(ws, queue, engine)
    try:
        await until(lambda: _is(queue, "w-fail", "starting", "converting the model"), 10, "w-fail converting the model")
        engine.step.set()
        await until(lambda: _is(queue, "w-fail", "starting", "loading the model"), 10, "w-fail loading the model")
        engine.step.set()
        with pytest.raises(EngineDead, match="cannot load model"):
            await asyncio.wait_for(task, 10)
        # still visible after the worker is gone, with the reason, for FAILED_TTL_S
        s = await status_of(queue, "w-fail")
        assert s is not None and s.failed and s.detail == "cannot load model /nope.gguf: FileNotFoundError"
        assert 1.0 < await queue.client.pttl(queue.keys.worker("cpu", "w-fail")) / 1000 <= FAILED_TTL_S
        assert not worker.ready.is_set()
    finally:
        await queue.close()


async def test_a_start_that_takes_too_long_fails_the_worker(redis_settings: RedisSettings) -> None:
    ws = settings("w-stuck", start_timeout_s=0.3)
    queue = RedisQueue.from_settings(redis_settings)
    worker = Worker(ws, queue, SlowStart(ws), block_ms=100)  # never let through
    try:
        with pytest.raises(EngineDead, match=r"did not start within 0\.3 s"):
            await asyncio.wait_for(worker.run(asyncio.Event()), 10)
        s = await status_of(queue, "w-stuck")
        assert s is not None and s.failed
    finally:
        await queue.close()


async def test_a_dead_engine_found_by_the_health_check_stops_the_worker(redis_settings: RedisSettings) -> None:
    ws = settings("w-check", health_check_s=0.1)
    queue = RedisQueue.from_settings(redis_settings)
    engine = FakeEngine(ws)
    worker, task = running(ws, queue, engine)
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        engine.dead = True  # no request in flight: only the periodic check can notice
        with pytest.raises(EngineDead, match="dead"):
            await asyncio.wait_for(task, 10)
        s = await status_of(queue, "w-check")
        assert s is not None and s.failed
    finally:
        await queue.close()


async def test_a_wedged_engine_makes_the_worker_leave_at_once_and_hand_its_jobs_back(
    redis_settings: RedisSettings,
) -> None:
    ws = settings("w-wedge", health_check_s=0.1, wedge_timeout_s=0.5, fake_step_s=0.01, grace_s=30)
    queue = RedisQueue.from_settings(redis_settings)
    engine = FakeEngine(ws)
    worker, task = running(ws, queue, engine)
    try:
        events, first = await streaming(worker, queue, "stuck")
        got: list[JobEvent] = [first]
        engine.wedged = True  # check_health still passes: only the lack of progress tells
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineDead, match="no progress"):
            await asyncio.wait_for(task, 10)
        took = asyncio.get_running_loop().time() - t0
        assert took < 5, took  # not the 30-s drain grace: a wedged engine will not drain
        assert worker.wedged and await status_of(queue, "w-wedge") is None  # withdrawn: gateways fail over
        async for _i, ev in events:
            got.append(ev)
            if ev.handed_back:
                break
        last = got[-1]
        assert last.handed_back and not last.terminal, last  # handed back, not cancelled nor ended
        (taken,) = await queue.reclaim("cpu", "w-other", 0, 10, ws.max_deliveries)  # left for another
        assert taken.request.request_id == "stuck" and taken.started and taken.begun[-1].handed_back
    finally:
        engine.wedged = False
        with contextlib.suppress(Exception):
            await engine.shutdown()
        await queue.close()


class RecordsOnceLetGo(MemoryBatches):
    """A batch store whose ``record`` fails QueueUnavailable (Redis out) until ``let_go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.let_go = asyncio.Event()
        self.refused = 0

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        if not self.let_go.is_set():
            self.refused += 1
            raise QueueUnavailable("the queue is unreachable")
        return await super().record(lease, result)


async def test_items_waiting_on_redis_to_record_their_results_are_not_an_engine_wedge() -> None:
    """The engine finished the item and is idle; its result waits on Redis (down) far past the wedge
    timeout. The worker stays (no progress is due from an idle engine) and records it once Redis is back."""
    ws = settings("w-rec", health_check_s=0.05, wedge_timeout_s=0.2, fake_step_s=0.01)
    queue, store = MemoryQueue(), RecordsOnceLetGo()
    await store.join("cpu")
    info, items = batch("b", 1, max_tokens=3)
    await store.create(info, "fp", items)
    engine = FakeEngine(ws)
    stop = asyncio.Event()
    worker = Worker(ws, queue, engine, block_ms=100, batches=store)
    task = asyncio.create_task(worker.run(stop))
    try:
        # Refused five times: over a second (the record's retries wait 0.05, 0.1, 0.2, 0.4 s, then
        # about 0.5 s each), five times the wedge timeout, with the engine idle all along.
        async def refused_five_times() -> bool:
            return store.refused >= 5

        async def recorded() -> bool:
            b = await store.get("b")
            return b is not None and b.succeeded == 1

        await until(refused_five_times, 10, "five refused records")
        assert not task.done() and not worker.wedged and worker.inflight == 1
        store.let_go.set()
        await until(recorded, 10, "the item's result recorded")
        assert not task.done() and not worker.wedged
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


class PublishBreaks(RedisQueue):
    """A queue whose ``publish`` fails with an unexpected error (not QueueUnavailable) once ``broken``."""

    broken = False

    async def publish(self, events, watch):  # type: ignore[no-untyped-def]
        if self.broken:
            raise RuntimeError("a bug in the event writer")
        return await super().publish(events, watch)


async def test_an_event_writer_that_breaks_makes_the_worker_leave_and_its_job_stays_for_another(
    redis_settings: RedisSettings,
) -> None:
    """The flusher cannot write past an unexpected error: rather than keep a fresh heartbeat over streams
    that no longer move, the worker withdraws it at once (the gateways fail its streams over), exits with
    the reason, and leaves the job unacked for another worker."""
    ws = settings("w-pub", fake_step_s=0.01, grace_s=30)
    queue = PublishBreaks.from_settings(redis_settings)
    assert isinstance(queue, PublishBreaks)
    engine = FakeEngine(ws)
    worker, task = running(ws, queue, engine)
    try:
        await streaming(worker, queue, "pub")
        queue.broken = True
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineDead, match="could not publish its events"):
            await asyncio.wait_for(task, 10)
        assert asyncio.get_running_loop().time() - t0 < 5  # not the 30-s drain grace
        assert worker.wedged and await status_of(queue, "w-pub") is None
        taken = await queue.reclaim("cpu", "w-other", 0, 10, ws.max_deliveries)
        assert [lease.request.request_id for lease in taken] == ["pub"]
    finally:
        with contextlib.suppress(Exception):
            await engine.shutdown()
        await queue.close()


async def test_an_event_writer_that_breaks_while_draining_cuts_the_drain_short(redis_settings: RedisSettings) -> None:
    """Stopped with a long request in flight, the worker drains with its heartbeat on; if its event writer
    fails then, the request can no longer move: the worker leaves at once (not after the 30-s grace),
    withdraws its heartbeat and leaves the job unacked for another worker."""
    ws = settings("w-drain", fake_step_s=0.01, grace_s=30)
    queue = PublishBreaks.from_settings(redis_settings)
    assert isinstance(queue, PublishBreaks)
    engine = FakeEngine(ws)
    stop = asyncio.Event()
    worker, task = running(ws, queue, engine, stop)
    try:
        events, _first = await streaming(worker, queue, "drained")
        with capture_logs() as logs:
            stop.set()
            await until(lambda: _logged(logs, "worker_draining"), 10, "worker_draining logged")
            assert not task.done() and await status_of(queue, "w-drain") is not None  # draining, heartbeat on
            queue.broken = True
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(EngineDead, match="could not publish its events"):
                await asyncio.wait_for(task, 10)
        assert asyncio.get_running_loop().time() - t0 < 5  # not the 30-s drain grace
        assert any(e["event"] == "worker_drain_cut" for e in logs)
        assert worker.wedged and await status_of(queue, "w-drain") is None
        taken = await queue.reclaim("cpu", "w-other", 0, 10, ws.max_deliveries)
        assert [lease.request.request_id for lease in taken] == ["drained"]
        await events.aclose()
    finally:
        with contextlib.suppress(Exception):
            await engine.shutdown()
        await queue.close()


def _logged(logs: list[dict[str, object]], event: str) -> bool:
    return any(e["event"] == event for e in logs)


async def test_jobs_of_data_redis_lost_stop_writing_and_the_worker_serves_on(redis_settings: RedisSettings) -> None:
    """Redis comes back empty (its keys gone, the epoch with them) while a job runs: the worker sees
    the queue's epoch change at its next heartbeat, stops that job and writes nothing more of it (a
    request sent again under its id must not see the old job's events), and serves new jobs."""
    ws = settings("w-lost", fake_step_s=0.02, grace_s=0)
    queue = RedisQueue.from_settings(redis_settings)
    engine = FakeEngine(ws)
    stop = asyncio.Event()
    worker, task = running(ws, queue, engine, stop)
    try:
        events, _first = await streaming(worker, queue, "old")
        await events.aclose()
        with capture_logs() as logs:
            keys = [key async for key in queue.client.scan_iter(f"{queue.keys.prefix}:*")]
            await queue.client.delete(*keys)  # all at once, as a restart empty leaves it
            await until(lambda: _logged(logs, "redis_data_lost"), 5, "the worker to see the data lost")
        assert "old" in engine.aborted and "old" not in worker.jobs
        written = await queue.client.xlen(queue.keys.events("old"))
        await queue.join("cpu")
        _events, first = await streaming(worker, queue, "new")  # a new job runs and is written
        assert first.token_ids
        assert written <= 3  # what it wrote in the heartbeat before it saw (at most a few steps)
        assert await queue.client.xlen(queue.keys.events("old")) == written
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await queue.close()
