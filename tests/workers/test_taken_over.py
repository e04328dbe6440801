"""Jobs another worker takes over, against a real Redis and the fake engine: one a dead worker had
begun goes on where its stream stood; one whose stream has a gap ends worker_died; one whose engine
died under it is handed back and carried on by the next worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from llamamesh.errors import EngineDead, QueueUnavailable
from llamamesh.queue.keys import WORKER_GROUP
from llamamesh.queue.protocol import Lease
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import FinishReason, GenerationRequest, JobEvent, SamplingParams, WorkerStatus
from tests.waiting import until
from tests.workers.test_worker_lifecycle import running, settings
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


async def _fake_tokens(req: GenerationRequest) -> list[int]:
    """The tokens the fake engine generates for ``req`` uninterrupted."""
    engine = FakeEngine(settings("w-whole"))
    await engine.start()
    return [t async for d in engine.stream(req) for t in d.token_ids]


async def _reclaimed_by_heir(
    redis_settings: RedisSettings, req: GenerationRequest, begun: list[JobEvent]
) -> tuple[list[JobEvent], FakeEngine]:
    """``req`` leased by a worker that published ``begun`` and died; the events of its stream once
    another worker (claim idle 0.3 s) took it over, and that worker's engine."""
    queue = RedisQueue.from_settings(redis_settings)
    try:
        await queue.join("cpu")
        await queue.submit("cpu", req)
        (lease,) = await queue.lease("cpu", "w-dead", 1, 500)
        await queue.publish([(lease, ev) for ev in begun], [])
        ws = settings("w-heir", claim_idle_s=0.3)
        engine = FakeEngine(ws)
        await until(lambda: _idle_past(queue, 300), 10, "the dead worker's lease to age past the claim idle time")
        stop = asyncio.Event()
        _worker, task = running(ws, queue, engine, stop)
        try:
            evs = [e async for _i, e in queue.events(req.request_id)]
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        return evs, engine
    finally:
        await queue.close()


async def test_a_job_a_dead_worker_had_begun_goes_on_where_its_stream_stood(redis_settings: RedisSettings) -> None:
    """Its caller may have its first tokens (or may come back for them: a detached resumable
    request): the worker that takes it over goes on from them on the same stream, fed after the
    input, instead of sending them again; the stream reads as one uninterrupted run."""
    request = GenerationRequest("half", "m", prompt="x", sampling=SamplingParams(max_tokens=9, seed=5))
    whole = await _fake_tokens(replace(request, request_id="whole"))
    begun = [JobEvent(token_ids=tuple(whole[:2]), index=0, worker="w-dead"), JobEvent(token_ids=(whole[2],), index=2)]
    evs, engine = await _reclaimed_by_heir(redis_settings, request, begun)
    assert [t for e in evs for t in e.token_ids] == whole  # nothing sent twice, nothing lost
    at = 0
    for e in evs:
        assert e.index == at, evs
        at += len(e.token_ids)
    end = evs[-1].finished
    assert end is not None and end.finish_reason is FinishReason.LENGTH and end.usage.completion_tokens == 9
    assert engine.served == ["half"]


async def test_a_begun_job_whose_stream_has_a_gap_ends_worker_died(redis_settings: RedisSettings) -> None:
    """What its stream holds cannot be trusted: it ends worker_died (a following gateway resumes
    it from what its caller has), and nothing runs."""
    request = GenerationRequest("gap", "m", prompt="x", sampling=SamplingParams(max_tokens=9))
    begun = [JobEvent(token_ids=(1,), index=0, worker="w-dead"), JobEvent(token_ids=(3,), index=2)]
    evs, engine = await _reclaimed_by_heir(redis_settings, request, begun)
    assert evs[-1].failed is not None and evs[-1].failed.code == "worker_died", evs[-1]
    assert engine.served == []


async def _idle_past(queue: RedisQueue, ms: int) -> bool:
    """Every job leased in the pool has been idle (untouched) for more than ``ms``."""
    rows = await queue.client.xpending_range(queue.keys.jobs("cpu"), WORKER_GROUP, "-", "+", 10)
    return bool(rows) and all(int(r["time_since_delivered"]) > ms for r in rows)


def _contiguous(evs: list[JobEvent]) -> bool:
    at = 0
    for e in evs:
        if e.token_ids and e.index != at:
            return False
        at += len(e.token_ids)
    return True


async def test_a_job_whose_engine_died_under_it_is_carried_on_by_the_next_worker(redis_settings: RedisSettings) -> None:
    """No gateway follows it (its caller detached, or its gateway died): the worker whose engine
    died hands it back (a death, for a gateway counting them), leased, and stops; the next worker to
    claim it goes on from its stream, which reads as one uninterrupted run."""
    request = GenerationRequest("d", "m", prompt="x", sampling=SamplingParams(max_tokens=40, seed=3))
    whole = await _fake_tokens(replace(request, request_id="whole"))
    queue = RedisQueue.from_settings(redis_settings)
    ws = settings("w-dead", fake_step_s=0.02)
    engine = FakeEngine(ws)
    worker, task = running(ws, queue, engine)
    stop = asyncio.Event()
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        await queue.submit("cpu", request)
        got: list[JobEvent] = []
        events = queue.events("d")
        async for _i, ev in events:
            got.append(ev)
            engine.dead = True
            if ev.handed_back:
                break
        with pytest.raises(EngineDead):
            await asyncio.wait_for(task, 10)
        back = got[-1]
        assert back.handed_back and back.engine_died and not back.terminal, back
        assert 0 < sum(len(e.token_ids) for e in got) < 40
        await until(lambda: _idle_past(queue, 300), 10, "the lease to age past the heir's claim idle time")
        heir = FakeEngine(settings("w-heir"))
        _heir, heir_task = running(settings("w-heir", claim_idle_s=0.3), queue, heir, stop)
        got += [e async for _i, e in events]
        assert [t for e in got for t in e.token_ids] == whole and _contiguous(got), got  # none twice, none lost
        end = got[-1].finished
        assert end is not None and end.finish_reason is FinishReason.LENGTH and end.usage.completion_tokens == 40
        assert heir.served == ["d"]
        rows = await queue.client.xpending_range(queue.keys.jobs("cpu"), WORKER_GROUP, "-", "+", 10)
        assert rows == []  # acked once carried to its end
        stop.set()
        await asyncio.wait_for(heir_task, 10)
    finally:
        stop.set()
        await queue.close()


async def test_a_job_leased_as_the_engine_died_is_handed_back_not_ended(redis_settings: RedisSettings) -> None:
    """The worker's blocking read returns a job just after its engine died: the job never ran, so it
    is handed back without a death (a gateway following it moves it at once), still leased for the
    worker that claims it next."""
    queue = RedisQueue.from_settings(redis_settings)
    ws = settings("w-late", health_check_s=0.05)
    engine = FakeEngine(ws)
    worker = Worker(ws, queue, engine, block_ms=3000)
    task = asyncio.create_task(worker.run(asyncio.Event()))
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        engine.dead = True
        await until(lambda: _died(worker), 5, "the watchdog to find the engine dead")
        await queue.submit("cpu", GenerationRequest("late", "m", prompt="x", sampling=SamplingParams(max_tokens=5)))
        with pytest.raises(EngineDead):
            await asyncio.wait_for(task, 10)
        (back,) = [e async for _i, e in _until_handed_back(queue, "late")]
        assert back.handed_back and not back.engine_died and not back.terminal, back
        assert engine.served == []
        (lease,) = await queue.reclaim("cpu", "w-next", 0, 10, ws.max_deliveries)
        assert lease.request.request_id == "late"
    finally:
        await queue.close()


async def _died(worker: Worker) -> bool:
    return worker.engine_died is not None


async def _until_handed_back(queue: RedisQueue, rid: str) -> AsyncIterator[tuple[str, JobEvent]]:
    async for i, ev in queue.events(rid):
        yield i, ev
        if ev.last_of_worker:
            return


async def _owner(queue: RedisQueue) -> str | None:
    rows = await queue.client.xpending_range(queue.keys.jobs("cpu"), WORKER_GROUP, "-", "+", 10)
    return rows[0]["consumer"].decode() if rows else None


async def test_a_job_taken_over_from_a_live_worker_stops_there_and_stays_with_the_other(
    redis_settings: RedisSettings,
) -> None:
    """A worker paused (or cut off from Redis) past the claim idle time looks dead, and another one
    takes its job over. When it comes back, its heartbeat must not take the job back (both would
    run it, each writing its tokens and a terminal event into one stream): it stops the job, writing
    nothing more, and the job stays with the worker that took it."""
    queue = RedisQueue.from_settings(redis_settings)
    ws = settings("w-paused", fake_step_s=0.05)
    stop = asyncio.Event()
    worker, task = running(ws, queue, FakeEngine(ws), stop)
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        await queue.submit("cpu", GenerationRequest("long", "m", prompt="x", sampling=SamplingParams(max_tokens=400)))
        events = queue.events("long")
        await anext(events)  # it runs
        (entry,) = await queue.client.xpending_range(queue.keys.jobs("cpu"), WORKER_GROUP, "-", "+", 10)
        # What a reclaiming worker does to a job untouched for its claim idle time.
        await queue.client.xclaim(queue.keys.jobs("cpu"), WORKER_GROUP, "w-heir", 0, [entry["message_id"]])
        await until(lambda: "long" not in worker.jobs.running, 10, "the paused worker to stop the job taken from it")
        assert await _owner(queue) == "w-heir"
        held = await queue.read_events("long")
        assert not any(ev.terminal for _i, ev in held), held[-1]
        await until(lambda: _idle_past(queue, 300), 10, "six heartbeats of the paused worker, none touching it")
        assert await _owner(queue) == "w-heir" and await queue.read_events("long") == held  # nothing more
        assert "long" not in worker.jobs and not task.done()  # the worker serves on
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await queue.close()


class _Outage:
    """A queue whose worker-side heartbeat fails (Redis out) while ``out``, noting when it last did,
    and which notes when the worker looks for jobs to reclaim."""

    def __init__(self, queue: RedisQueue) -> None:
        self._q = queue
        self.out = False
        self.failed_at: list[float] = []
        self.reclaimed_at: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._q, name)

    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> list[str]:
        if self.out:
            self.failed_at.append(time.monotonic())
            raise QueueUnavailable("Redis is out")
        return await self._q.heartbeat(status, ttl_s, touch)

    async def reclaim(self, *args: Any, **kw: Any) -> list[Lease]:
        if not kw.get("own"):
            self.reclaimed_at.append(time.monotonic())
        return await self._q.reclaim(*args, **kw)


async def test_a_worker_that_saw_redis_out_only_in_its_heartbeat_reclaims_nothing_until_others_touched_theirs(
    redis_settings: RedisSettings,
) -> None:
    """While Redis is out no worker can touch its jobs, so right after it every live worker's jobs
    look idle. A worker whose slots were all full saw the outage only in its heartbeat; once its job
    ends it must still wait half the claim idle time (a round of the others' heartbeats) before it
    reclaims anything, or it takes a live worker's job."""
    queue = _Outage(RedisQueue.from_settings(redis_settings))
    ws = settings("w-full", fake_step_s=0.05, claim_idle_s=2.0, max_inflight=1, tenant_headroom=0)
    stop = asyncio.Event()
    worker, task = running(ws, queue, FakeEngine(ws), stop)  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        await queue.submit("cpu", GenerationRequest("busy", "m", prompt="x", sampling=SamplingParams(max_tokens=40)))

        async def near_its_end() -> None:  # its job ends within claim_idle_s / 2 of the outage
            async for _i, ev in queue.events("busy"):
                if ev.index >= 32 or ev.terminal:
                    return

        await asyncio.wait_for(near_its_end(), 10)
        queue.out = True
        await until(lambda: len(queue.failed_at) >= 2, 5, "its heartbeat to find Redis out")
        queue.out = False
        await until(lambda: "busy" not in worker.jobs and queue.reclaimed_at, 15, "a reclaim after the job ended")
        assert queue.reclaimed_at[0] >= queue.failed_at[-1] + ws.claim_idle_s / 2, (queue.reclaimed_at, queue.failed_at)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await queue.close()
