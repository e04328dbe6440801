"""The job as an object (workers/job.py), method by method: deltas become events with contiguous indexes
per sample, and every way a job ends (finished, cancelled, handed back, its engine dead, a crash, a
deadline) publishes exactly one terminal event. No Redis: a recording sink and a scripted engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from llamamesh.errors import DeadlineExceeded, EngineDead
from llamamesh.queue.protocol import Lease
from llamamesh.types import FinishReason, GenerationRequest, JobEvent, JobKind, SamplingParams, TokenDelta
from workers.engines.base import EngineStats
from workers.job import Job
from workers.samples import Samples

pytestmark = pytest.mark.timeout(10)


class Sink:
    """The outbox's side of a job: what it added, what it finished with (in order)."""

    def __init__(self) -> None:
        self.added: list[JobEvent] = []
        self.terminal: list[JobEvent] = []
        self.watched: list[str] = []
        self.some_added = asyncio.Event()

    def watch(self, lease: Lease) -> None:
        self.watched.append(lease.request.request_id)

    def add(self, lease: Lease, event: JobEvent) -> None:
        assert not self.terminal, "an event after the terminal one"
        self.added.append(event)
        self.some_added.set()

    async def finish(self, lease: Lease, event: JobEvent) -> None:
        self.terminal.append(event)


class Scripted:
    """An engine whose stream yields what the test puts in ``feed``: a delta, an exception to raise, or
    None to end the stream (without a finish reason)."""

    parallel_samples = True
    model_name = "m"
    starting = ""

    def __init__(self) -> None:
        self.feed: asyncio.Queue[TokenDelta | BaseException | None] = asyncio.Queue()
        self.aborted: list[str] = []
        self.streamed: list[str] = []

    async def start(self) -> None:
        pass

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.streamed.append(request.request_id)
        while True:
            item = await self.feed.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.feed.put_nowait(TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=2))

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        return [7, 8, 9]

    async def check_health(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats()

    async def shutdown(self) -> None:
        pass


def lease(n: int = 1, **kw: object) -> Lease:
    req = GenerationRequest("r1", "m", prompt="x", sampling=SamplingParams(max_tokens=50, n=n), **kw)  # type: ignore[arg-type]
    return Lease("cpu", "1-0", req)


def job(n: int = 1, stopping: asyncio.Event | None = None, **kw: object) -> tuple[Job, Sink, Scripted]:
    engine, sink = Scripted(), Sink()
    return Job(lease(n, **kw), Samples(engine), sink, "w-1", stopping), sink, engine  # type: ignore[arg-type]


def d(text: str, ids: tuple[int, ...], sample: int = 0, end: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(text, ids, finish_reason=end, prompt_tokens=2 if end else None, sample=sample)


# --- on_delta: one delta at a time


def test_each_samples_events_carry_contiguous_indexes_and_the_last_end_is_the_terminal_event() -> None:
    j, sink, _ = job(n=2)
    deltas = [
        d(" a", (1,)),
        d(" b", (2, 3), sample=1),
        d("", ()),
        d(" c", (4,)),
        d(" d", (5,), sample=1, end=FinishReason.STOP),
        d(" e", (6,), end=FinishReason.LENGTH),
    ]
    results = [j.on_delta(x) for x in deltas]
    assert results[:-1] == [None] * 5
    # (the empty delta is no event)
    assert [(e.sample, e.index, e.token_ids) for e in sink.added] == [
        (0, 0, (1,)),
        (1, 0, (2, 3)),
        (0, 1, (4,)),
        (1, 2, (5,)),
    ]
    assert sink.added[-1].sample_end is FinishReason.STOP and sink.added[-1].finished is None
    end = results[-1]
    assert end is not None and (end.sample, end.index, end.token_ids) == (0, 2, (6,))
    assert end.finished is not None and end.finished.finish_reason is FinishReason.LENGTH
    assert (end.finished.usage.prompt_tokens, end.finished.usage.completion_tokens) == (2, 6)  # every sample's
    assert end.finished.first_token_unix_ns >= j.started > 0


def test_a_cancelled_sample_ends_the_job_at_once() -> None:
    j, sink, _ = job(n=3)
    assert j.on_delta(d(" a", (1,), sample=2)) is None
    end = j.on_delta(d("", (), sample=0, end=FinishReason.CANCELLED))
    assert end is not None and end.finished is not None and end.finished.finish_reason is FinishReason.CANCELLED
    assert end.finished.usage.completion_tokens == 1 and [e.token_ids for e in sink.added] == [(1,)]


async def test_an_abort_by_the_drain_or_at_the_deadline_is_not_the_callers_cancel() -> None:
    """The drain's abort hands the job back: its last event says so and is not terminal (the lease
    stays for another worker to carry on); the deadline's ends it DEADLINE_EXCEEDED."""
    stopping = asyncio.Event()
    j, sink, engine = job(stopping=stopping)
    stopping.set()
    for x in (d(" a", (1,)), d("", (), end=FinishReason.CANCELLED)):
        engine.feed.put_nowait(x)
    with capture_logs() as logs:
        await j.run()
    (last,) = sink.terminal
    assert last.handed_back and not last.terminal and last.worker == j.worker
    assert [e["status"] for e in logs if e["event"] == "job_finished"] == ["handed_back"]
    late, _, _ = job(deadline_unix_ns=time.time_ns() - 1)
    with pytest.raises(DeadlineExceeded, match="after 0 tokens"):
        late.on_delta(d("", (), end=FinishReason.CANCELLED))


# --- cancelled / failed: the terminal event of a job that did not finish


def test_a_cancelled_job_ends_cancelled_unless_the_worker_gives_it_up() -> None:
    stopping = asyncio.Event()
    j, _, _ = job(stopping=stopping)
    j.on_delta(d(" a", (1, 2)))
    ev = j.cancelled()
    assert ev.finished is not None and ev.finished.finish_reason is FinishReason.CANCELLED
    assert ev.finished.usage.completion_tokens == 2 and ev.failed is None
    stopping.set()
    back = j.cancelled()
    assert back.handed_back and not back.terminal
    dead = j.failed(EngineDead("gone")).failed
    assert dead is not None and (dead.code, dead.message) == ("engine_dead", "gone")


# --- run: the whole job


async def test_a_finished_job_publishes_its_deltas_then_one_terminal_event_and_logs_it() -> None:
    j, sink, engine = job()
    for x in (d(" a", (1,)), d(" b", (2,)), d(" c", (3,), end=FinishReason.STOP)):
        engine.feed.put_nowait(x)
    with capture_logs() as logs:
        await j.run()
    assert sink.watched == ["r1"] and [e.index for e in sink.added] == [0, 1]
    (end,) = sink.terminal
    assert end.finished is not None and end.finished.finish_reason is FinishReason.STOP and end.index == 2
    (line,) = [x for x in logs if x["event"] == "job_finished"]
    assert line["status"] == "ok" and line["completion_tokens"] == 3 and line["prompt_tokens"] == 2


async def test_a_job_cancelled_mid_stream_publishes_one_cancelled_event_and_re_raises() -> None:
    j, sink, engine = job()
    engine.feed.put_nowait(d(" a", (1,)))
    task = asyncio.create_task(j.run())
    await asyncio.wait_for(sink.some_added.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (end,) = sink.terminal
    assert end.finished is not None and end.finished.finish_reason is FinishReason.CANCELLED
    assert end.finished.usage.completion_tokens == 1


async def test_an_engine_death_mid_stream_hands_the_job_back_then_raises() -> None:
    """The job is given up, not ended: another worker carries it on from its stream; the hand-back
    says the engine died (a gateway counts the death)."""
    j, sink, engine = job()
    engine.feed.put_nowait(d(" a", (1,)))
    engine.feed.put_nowait(EngineDead("the GPU fell off the bus"))
    with pytest.raises(EngineDead, match="GPU"):
        await j.run()
    assert [e.token_ids for e in sink.added] == [(1,)]
    (end,) = sink.terminal
    assert end.handed_back and end.engine_died and not end.terminal, end


@pytest.mark.parametrize(
    ("fed", "code"),
    [(RuntimeError("a bug"), "internal"), (d(" a", (1,)), "internal")],
    ids=["crash", "no_finish"],
)
async def test_a_crash_or_a_stream_without_an_end_fails_the_job(fed: TokenDelta | Exception, code: str) -> None:
    j, sink, engine = job()
    engine.feed.put_nowait(fed)
    if isinstance(fed, TokenDelta):
        engine.feed.put_nowait(None)  # the stream ends without a finish reason
    await j.run()
    (end,) = sink.terminal
    assert end.failed is not None and end.failed.code == code


async def test_a_tokenize_job_ends_with_its_ids() -> None:
    j, sink, engine = job(kind=JobKind.TOKENIZE)
    await j.run()
    assert sink.terminal == [JobEvent(token_ids=(7, 8, 9), tokenized=True, worker="w-1")]
    assert engine.streamed == [] and sink.added == []


async def test_a_job_past_its_deadline_never_runs_and_one_before_it_is_aborted_there() -> None:
    gone, sink, engine = job(deadline_unix_ns=time.time_ns() - 1)
    await gone.run()
    (end,) = sink.terminal
    assert end.failed is not None and end.failed.code == "deadline_exceeded" and engine.streamed == []
    soon, sink, engine = job(deadline_unix_ns=time.time_ns() + 50_000_000)
    engine.feed.put_nowait(d(" a", (1,)))
    await soon.run()  # the engine's abort (at the deadline) ends its stream CANCELLED
    assert engine.aborted == ["r1"]
    (end,) = sink.terminal
    assert end.failed is not None and end.failed.code == "deadline_exceeded"
