"""The relayed request (services/relayed.py), step by step over the in-memory queue: each step keeps
the stream's invariants (every token index once and in order across failovers, exactly one
terminal event) and does its own bookkeeping; then the whole stream, lost and resumed at any
points by a hand-driven worker."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamamesh import errors
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import BreakerSettings, GatewaySettings
from llamamesh.types import (
    Attempt,
    Failure,
    Finished,
    FinishReason,
    GenerationRequest,
    JobEvent,
    SamplingParams,
    Usage,
    WorkerStatus,
)
from services.backends import Backends
from services.detach import DetachTimers
from services.liveness import Liveness
from services.relayed import Caller, Progress, RelayedRequest, RelayParts
from services.routing import RoutingPolicy

pytestmark = pytest.mark.timeout(30)

SETTINGS = GatewaySettings(port=0, failover_attempts=5, max_worker_deaths=2, reattach_grace_s=3600)


async def parts(s: GatewaySettings = SETTINGS) -> RelayParts:
    """A relay's shared parts over a fresh queue, with a live worker "w" in pool cpu (no probes run;
    liveness checks only after 30 s without an event)."""
    q = MemoryQueue()
    await q.heartbeat(WorkerStatus(worker="w", pool="cpu"), ttl_s=60)
    b = Backends(q, ["cpu"], {}, BreakerSettings(probe_interval_s=30))
    await b.refresh(b.pools["cpu"])
    return RelayParts(q, s, b, RoutingPolicy(()), Liveness(q, s, b), DetachTimers(q, s.reattach_grace_s))


def queue_of(p: RelayParts) -> MemoryQueue:
    assert isinstance(p.queue, MemoryQueue)
    return p.queue


def request(rid: str = "r", max_tokens: int = 6, n: int | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model="tiny", prompt="x", sampling=SamplingParams(max_tokens=max_tokens, n=n)
    )


def tok(index: int, *tokens: int, sample: int = 0) -> JobEvent:
    return JobEvent(text="".join(f"<{t}>" for t in tokens), token_ids=tokens, index=index, sample=sample, worker="w")


def end(index: int, completion: int) -> JobEvent:
    return JobEvent(index=index, finished=Finished(FinishReason.LENGTH, Usage(1, completion)), worker="w")


async def submitted(r: RelayedRequest) -> None:
    """The steps of ``events`` up to a queued attempt."""
    r.place()
    assert await r.begin()
    await r.submit()


async def queued() -> tuple[RelayedRequest, MemoryQueue]:
    """Request "r" (of the default settings) with its first attempt queued, and its queue."""
    p = await parts()
    r = RelayedRequest(p, request(), "cpu", Progress())
    r.route()
    await submitted(r)
    return r, queue_of(p)


async def test_accept_renumbers_a_resumed_attempt_drops_repeats_and_raises_on_a_gap() -> None:
    r = RelayedRequest(await parts(), request(max_tokens=6), "cpu", Progress())
    r.route()
    await submitted(r)
    assert [r.accept(e) is not None for e in (tok(0, 10, 11), tok(2, 12))] == [True, True]
    await r.fail_over(errors.WorkerLost("gone", running=True))
    await submitted(r)  # attempt 1 goes on from the 3 tokens the caller has
    assert r.attempt is not None and r.attempt.resume_token_ids == (10, 11, 12) and r.base == 3
    got = r.accept(tok(0, 13))  # numbered from 0 in the attempt's own stream
    assert got is not None and (got.index, got.token_ids) == (3, (13,))
    assert r.accept(tok(0, 13)) is None  # a retried publish: dropped
    with pytest.raises(errors.EventsLost, match=r"lost tokens 4\.\.5"):
        r.accept(tok(3, 16))
    last = r.accept(JobEvent(token_ids=(14, 15), index=1, finished=Finished(FinishReason.LENGTH, Usage(1, 3))))
    assert last is not None and last.index == 4 and last.finished is not None
    assert last.finished.usage.completion_tokens == 6  # what came before the attempt counts
    assert r.streams.cursors[0].sent == [10, 11, 12, 13, 14, 15] and r.progress.tokens == 6


async def test_read_ends_after_exactly_one_terminal_event_and_raises_the_failure_an_event_carries() -> None:
    p = await parts()
    q = queue_of(p)
    r = RelayedRequest(p, request(max_tokens=3), "cpu", Progress())
    r.route()
    await submitted(r)
    for ev in (tok(0, 1), tok(1, 2, 3), end(3, 3), tok(3, 9)):  # nothing after the terminal one is read
        await q.end("r", ev)
    got = [ev async for ev in r.read()]  # (what queued up unread may come merged)
    assert [t for e in got for t in e.token_ids] == [1, 2, 3] and got[0].index == 0
    assert [e.terminal for e in got].count(True) == 1 and got[-1].terminal
    assert r.finished and r.progress.tokens == 3 and r.progress.ttft_ms is not None

    failing = RelayedRequest(p, request("f"), "cpu", Progress())
    failing.route()
    await submitted(failing)
    await q.end("f", JobEvent(failed=Failure("engine_dead", "the engine died"), worker="w"))
    with pytest.raises(errors.EngineDead, match="the engine died"):
        [ev async for ev in failing.read()]


async def test_begin_records_each_attempt_and_a_second_begin_under_the_id_follows_the_first() -> None:
    p = await parts()
    q = queue_of(p)
    first = RelayedRequest(p, request(max_tokens=2), "cpu", Progress(), resumable=True, caller=Caller("same"))
    first.route()
    await submitted(first)
    (record,) = await q.attempts("r")
    assert (record.attempt_id, record.base, record.pool, record.resumable) == ("r", 0, "cpu", True)
    retry = RelayedRequest(p, request(max_tokens=2), "cpu", Progress(), caller=Caller("same"))
    retry.place()
    assert not await retry.begin()  # the id was accepted: the retry follows that request
    other = RelayedRequest(p, request(max_tokens=2), "cpu", Progress(), caller=Caller("different"))
    other.place()
    assert not await other.begin()
    with pytest.raises(errors.AlreadyExists):
        [ev async for ev in other.follow_accepted()]
    for ev in (tok(0, 1), end(1, 1)):
        await q.end("r", ev)
    followed = [ev async for ev in retry.follow_accepted()]
    assert [t for e in followed for t in e.token_ids] == [1] and [e.terminal for e in followed] == [True]
    assert retry.finished and len(await q.attempts("r")) == 1  # one job


async def test_spent_ends_end_each_sample_whose_tokens_the_caller_has_and_the_request_once() -> None:
    r = RelayedRequest(await parts(), request(max_tokens=2, n=3), "cpu", Progress())
    assert list(r.spent_ends()) == []  # nothing before an attempt was lost
    for ev in (tok(0, 1, 2, sample=0), tok(0, 3, sample=1), tok(0, 5, 6, sample=2)):
        r.streams.accept(ev)
    r.attempts = 1
    ends = list(r.spent_ends())  # samples 0 and 2 have their max_tokens: only their ends were missing
    assert [(e.sample, e.sample_end, e.terminal) for e in ends] == [
        (0, FinishReason.LENGTH, False),
        (2, FinishReason.LENGTH, False),
    ]
    assert not r.finished and r.streams.ended == {0, 2}
    r.streams.accept(tok(1, 4, sample=1))
    (last,) = r.spent_ends()  # the last one to end ends the request, with every sample's tokens
    assert last.terminal and last.finished is not None and last.finished.usage.completion_tokens == 6
    assert r.finished and list(r.spent_ends()) == []  # ended once


async def test_fail_over_cancels_the_lost_attempt_until_no_attempt_is_left() -> None:
    p = await parts(GatewaySettings(port=0, failover_attempts=1, max_worker_deaths=0))
    q = queue_of(p)
    r = RelayedRequest(p, request(), "cpu", Progress())
    r.route()
    await submitted(r)
    await r.fail_over(errors.EventsLost("lost"))
    assert q.is_cancelled("r") and r.attempts == r.progress.failovers == 1 and not r.submitted
    await submitted(r)
    assert r.attempt is not None and r.attempt.request_id == "r~1"
    with pytest.raises(errors.WorkerLost):
        await r.fail_over(errors.WorkerLost("gone again", running=True))
    assert [(d[1].request_id, d[3]) for d in q.dead] == [("r", 2)]  # it outlived both: kept for inspection


async def test_a_request_whose_workers_keep_dying_is_set_aside() -> None:
    r, q = await queued()
    await r.fail_over(errors.EngineDead("boom"))
    await submitted(r)
    with pytest.raises(errors.SetAside, match="2 workers died"):
        await r.fail_over(errors.WorkerLost("gone", running=True))
    assert r.deaths == 2 and len(q.dead) == 1


async def test_leave_detaches_a_resumable_request_whose_caller_went_away_and_cancels_any_other() -> None:
    p = await parts()
    q = queue_of(p)
    resumable = RelayedRequest(p, request("kept"), "cpu", Progress(), resumable=True)
    resumable.route()
    await submitted(resumable)
    resumable.failure = GeneratorExit()
    await resumable.leave()
    assert len(p.timers.tasks) == 1 and not q.is_cancelled("kept")
    plain = RelayedRequest(p, request("gone"), "cpu", Progress())
    plain.route()
    await submitted(plain)
    plain.failure = GeneratorExit()
    await plain.leave()
    assert q.is_cancelled("gone")
    ended = RelayedRequest(p, request("done"), "cpu", Progress())
    ended.route()
    await submitted(ended)
    ended.finished = True
    await ended.leave()
    assert not q.is_cancelled("done")
    await p.timers.close()


async def _worker(q: MemoryQueue, tokens: list[int], cuts: list[int], step: int, repeat: bool) -> list[str]:
    """Run each attempt of one request by hand: resume where the caller is, write its tokens ``step``
    at a time (each event twice with ``repeat``: a retried publish), and at each cut lose the
    attempt's next events (a gap: the relay fails over); the last one ends. The attempts' ids."""
    ids = []
    while True:
        (lease,) = await q.lease("cpu", "w", 1, 5000)
        req = lease.request
        ids.append(req.request_id)
        start = len(req.resume_token_ids)
        assert req.resume_token_ids == tuple(tokens[:start])  # resumed from exactly what the caller has
        stop = next((c for c in cuts if c > start), len(tokens))
        for at in range(start, stop, step):
            ev = tok(at - start, *tokens[at : min(at + step, stop)])
            for _ in range(2 if repeat else 1):
                await q.publish([(lease, ev)], [])
        if stop == len(tokens):
            await q.publish([(lease, end(stop - start, stop - start))], [])
            return ids
        await q.publish([(lease, tok(stop - start + 1, 0))], [])


async def _relay_through_losses(n: int, cuts: list[int], step: int, repeat: bool) -> None:
    p = await parts()
    q = queue_of(p)
    tokens = list(range(100, 100 + n))
    progress = Progress()
    relayed = RelayedRequest(p, request(max_tokens=n), "cpu", progress)

    async def read() -> list[JobEvent]:
        return [ev async for ev in relayed.events()]

    got, attempts = await asyncio.wait_for(asyncio.gather(read(), _worker(q, tokens, cuts, step, repeat)), 10)
    sent = [e for e in got if e.token_ids]
    assert [t for e in sent for t in e.token_ids] == tokens
    assert [e.index for e in sent] == [sum(len(e.token_ids) for e in sent[:i]) for i in range(len(sent))]
    assert [e.terminal for e in got].count(True) == 1 and got[-1].terminal
    assert got[-1].finished is not None and got[-1].finished.usage.completion_tokens == n
    assert attempts == ["r", *(f"r~{i}" for i in range(1, len(cuts) + 1))] and progress.failovers == len(cuts)
    assert all(q.is_cancelled(a) for a in attempts[:-1])  # every lost attempt was cancelled


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(2, 12).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(1, n - 1), max_size=3, unique=True).map(sorted),
            st.integers(1, 3),
            st.booleans(),
        )
    )
)
def test_a_stream_lost_and_resumed_at_any_points_is_contiguous_and_ends_once(
    case: tuple[int, list[int], int, bool],
) -> None:
    asyncio.run(_relay_through_losses(*case))


async def test_an_attempt_record_carries_what_each_sample_had() -> None:
    p = await parts()
    r = RelayedRequest(p, request(max_tokens=4, n=2), "cpu", Progress())
    r.route()
    await submitted(r)
    for ev in (tok(0, 1, 2, sample=0), JobEvent(token_ids=(5,), index=0, sample=1, sample_end=FinishReason.STOP)):
        r.accept(ev)
    await r.fail_over(errors.EventsLost("lost"))
    await submitted(r)
    assert r.record == Attempt("r~1", 3, "cpu", "tiny", 0, False, "", (2, 1), (1,))
    assert r.attempt is not None and dict(r.attempt.resume_samples) == {0: (1, 2)}  # sample 1 had ended


async def test_watched_gives_up_on_a_worker_that_stopped_answering_and_on_a_queue_that_lost_its_data() -> None:
    q = MemoryQueue()
    await q.heartbeat(WorkerStatus(worker="w", pool="cpu"), ttl_s=60)
    b = Backends(q, ["cpu"], {}, BreakerSettings(probe_interval_s=0.05))  # liveness checked every 50 ms idle
    await b.refresh(b.pools["cpu"])
    await q.end("j", tok(0, 1))
    events = Liveness(q, SETTINGS, b).watched("cpu", "j")
    assert (await anext(events)).token_ids == (1,)
    await q.leave("cpu", "w")
    await b.refresh(b.pools["cpu"])
    with pytest.raises(errors.WorkerLost, match="stopped answering"):
        await anext(events)
    generation = [0]
    await q.end("k", tok(0, 1))
    lost = Liveness(q, SETTINGS, b, lambda: generation[0]).watched("cpu", "k")
    assert (await anext(lost)).token_ids == (1,)
    generation[0] = 1  # Redis came back without its data
    with pytest.raises(errors.QueueUnavailable, match="without its data"):
        await anext(lost)
    # A job queued to the data Redis holds now (after it came back, before the gateway saw it had)
    # is not lost: its stream goes on.
    await q.submit("cpu", GenerationRequest(request_id="m", model="tiny", prompt="x"))
    await q.end("m", tok(0, 1))
    kept = Liveness(q, SETTINGS, b, lambda: generation[0]).watched("cpu", "m")
    assert (await anext(kept)).token_ids == (1,)
    generation[0] = 2
    await q.end("m", tok(1, 2))
    assert (await anext(kept)).token_ids == (2,)


@pytest.mark.parametrize("step", ["begin", "submit"])
async def test_a_caller_gone_while_its_job_is_queued_has_the_job_queued_and_cancelled(step: str) -> None:
    """The caller goes away while the attempt's record, or its job's submission, is in flight and
    lands all the same: the record and the job are both written (a record with no job would keep an
    Attach or a retry waiting for ever), and the stream's bookkeeping cancels the job (else it would
    run to its end for nobody)."""
    p = await parts()
    q = queue_of(p)
    landed, hold = asyncio.Event(), asyncio.Event()
    real = getattr(q, step)

    async def slow(*args: object, **kwargs: object) -> object:
        done = await real(*args, **kwargs)
        landed.set()
        await hold.wait()  # the reply still on its way when the caller goes
        return done

    setattr(q, step, slow)
    stream = RelayedRequest(p, request("gone"), "cpu", Progress()).events()
    reading = asyncio.create_task(anext(stream))
    await asyncio.wait_for(landed.wait(), 5)
    reading.cancel()
    await asyncio.sleep(0)
    assert not reading.done()  # it waits for the reply
    hold.set()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await stream.aclose()
    assert [a.attempt_id for a in await q.attempts("gone")] == ["gone"]
    (lease,) = await q.lease("cpu", "w", 1, 0)
    assert lease.cancelled  # the worker that takes it skips it, ending its stream


async def test_an_attempt_another_worker_carried_on_counts_the_death_it_went_on_from() -> None:
    """The first worker died and a second carried the attempt on before the gateway saw the loss:
    when the second dies too, that is two deaths, and the request is set aside (not sent to a third)."""
    r, q = await queued()
    await q.end("r", tok(0, 1))
    await q.end("r", JobEvent(token_ids=(2,), index=1, worker="w2"))  # carried on by w2
    await q.end("r", JobEvent(failed=Failure("worker_lost", "w2 lost", True), worker="w2"))
    with pytest.raises(errors.WorkerLost):
        [ev async for ev in r.read()]
    assert r.deaths == 1
    with pytest.raises(errors.SetAside, match="2 workers died"):
        await r.fail_over(errors.WorkerLost("w2 gone", running=True))


async def test_a_worker_died_failure_from_the_claiming_worker_counts_one_death() -> None:
    """The worker that claimed a dead worker's job could not carry it on and says so: one death."""
    r, q = await queued()
    await q.end("r", tok(0, 1))
    await q.end("r", JobEvent(failed=Failure("worker_died", "the worker running it died", True), worker="w2"))
    with pytest.raises(errors.WorkerDied) as lost:
        [ev async for ev in r.read()]
    await r.fail_over(lost.value)
    assert r.deaths == 1 and r.attempts == 1
