"""The stream invariant (services/cursor.py ``Cursor``), event merging (``JobEvent.then``), an
Attach's reading through a request's attempts (services/attach.py), and the relay's ownership of its
detach timers."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from llamamesh import errors
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import Attempt, Failure, Finished, FinishReason, JobEvent, Usage
from services import liveness
from services.attach import Attachment
from services.detach import DetachTimers
from services.liveness import Liveness
from services.relay import Cursor, QueueRelay, SampleCursors
from tests.waiting import until

pytestmark = pytest.mark.timeout(10)


def ev(index: int, *tokens: int, end: bool = False) -> JobEvent:
    finished = Finished(FinishReason.LENGTH, Usage(1, index + len(tokens))) if end else None
    return JobEvent(text="".join(f"<{t}>" for t in tokens), token_ids=tokens, index=index, finished=finished)


def test_each_index_passes_once_and_a_repeat_is_dropped_and_counted() -> None:
    c = Cursor()
    before = Cursor.duplicates_dropped
    out = [c.accept(e) for e in (ev(0, 10, 11), ev(2, 12), ev(0, 10, 11), ev(2, 12), ev(3, 13, end=True))]
    assert [o.token_ids if o else None for o in out] == [(10, 11), (12,), None, None, (13,)]
    assert c.sent == [10, 11, 12, 13]
    assert Cursor.duplicates_dropped - before == 2


def test_an_overlapping_event_gives_only_its_new_tokens() -> None:
    c = Cursor()
    c.accept(ev(0, 10, 11))
    out = c.accept(ev(1, 11, 12, 13))  # a retried publish merged with the next step's tokens
    assert out is not None and (out.index, out.token_ids) == (2, (12, 13))
    assert c.sent == [10, 11, 12, 13]


def test_a_gap_ends_the_stream_naming_the_lost_range() -> None:
    c = Cursor()
    c.accept(ev(0, 10, 11))
    with pytest.raises(errors.QueueUnavailable, match=r"lost tokens 2\.\.4"):
        c.accept(ev(5, 15))


def test_a_terminal_event_always_passes_with_what_is_new() -> None:
    c = Cursor()
    c.accept(ev(0, 10, 11))
    out = c.accept(ev(0, 10, 11, end=True))  # the terminal event repeated the last tokens
    assert out is not None and out.finished is not None and out.token_ids == ()
    empty = Cursor(offset=4).accept(JobEvent(index=0, finished=Finished(FinishReason.CANCELLED, Usage(0, 4))))
    assert empty is not None and empty.terminal  # an ending with no tokens carries no index to check


def test_an_attach_from_an_offset_starts_there() -> None:
    c = Cursor(offset=2)
    assert c.accept(ev(0, 10, 11)) is None
    out = c.accept(ev(1, 11, 12))
    assert out is not None and (out.index, out.token_ids) == (2, (12,))


def test_events_merge_only_when_they_follow_on() -> None:
    a = ev(0, 10, 11)
    assert a.then(ev(2, 12)).token_ids == (10, 11, 12)
    assert a.then(JobEvent(finished=Finished(FinishReason.STOP, Usage(1, 2)))).terminal
    assert not a.follows_on(ev(0, 10, 11)) and not a.follows_on(ev(3, 13))
    with pytest.raises(ValueError, match="does not follow on"):
        a.then(ev(0, 10, 11))


def sev(sample: int, index: int, *tokens: int, end: FinishReason | None = None) -> JobEvent:
    return JobEvent(token_ids=tokens, index=index, sample=sample, sample_end=end)


def test_events_of_different_samples_never_merge_nor_after_a_samples_end() -> None:
    assert sev(0, 0, 1).follows_on(sev(0, 1, 2)) and not sev(0, 0, 1).follows_on(sev(1, 1, 2))
    assert not sev(0, 0, 1, end=FinishReason.STOP).follows_on(sev(0, 1, 2))
    assert sev(0, 0, 1).then(sev(0, 1, 2, end=FinishReason.LENGTH)).ends_sample is FinishReason.LENGTH


def test_each_sample_keeps_its_own_invariant_and_ends_once() -> None:
    s = SampleCursors(2, offsets=[1, 0])
    assert s.accept(sev(0, 0, 10)) is None  # the caller has it
    assert s.accept(sev(1, 0, 20, 21)) is not None and s.accept(sev(0, 1, 11)) is not None
    with pytest.raises(errors.QueueUnavailable, match=r"lost tokens 2\.\.2"):
        s.accept(sev(1, 3, 23))
    end = s.accept(sev(1, 0, 20, 21, 22, end=FinishReason.STOP))  # a retried publish, with the end
    assert end is not None and end.token_ids == (22,) and end.sample_end is FinishReason.STOP
    assert s.accept(sev(1, 3, end=FinishReason.STOP)) is None  # its end again: dropped
    assert s.ended == {1} and s.total == 4 and s.bases() == (1, 3)
    with pytest.raises(errors.QueueUnavailable, match="sample 2"):
        s.accept(sev(2, 0, 1))


async def test_the_relay_owns_its_detach_timers_and_cancels_them_at_close() -> None:
    q = MemoryQueue()
    relay = QueueRelay(q, GatewaySettings(reattach_grace_s=3600))
    await relay.timers.start("caller", "caller")
    (timer,) = relay.timers.tasks
    assert not timer.done()
    await relay.close()
    assert timer.cancelled() and not relay.timers.tasks
    assert await q.read_events("caller") == []  # nothing was cancelled by a timer that never fired


async def attempts_of(q: MemoryQueue, rid: str = "r") -> None:
    """Request ``rid`` of 6 tokens in two attempts: the first lost after sending 4 tokens of which
    the caller had 3 when the second began (from there, numbered from 0 in its own stream)."""
    await q.begin(rid, Attempt(rid, 0, "cpu", "tiny", 1, True), first=True)
    for e in (ev(0, 10, 11), ev(2, 12, 13)):
        await q.end(rid, e)
    await q.begin(rid, Attempt(f"{rid}~1", 3, "cpu", "tiny", 1, True), first=False)
    for e in (ev(0, 13), ev(1, 14, 15, end=True)):
        await q.end(f"{rid}~1", e)


async def read_all(reading: Attachment) -> list[JobEvent]:
    return [e async for _head, e in reading.events()]


def attachment(q: MemoryQueue, offset: int = 0, count: bool = False, wait_s: float = 0) -> Attachment:
    s = GatewaySettings(reattach_grace_s=3600, lost_worker_wait_s=wait_s)
    return Attachment(q, Liveness(q, s), DetachTimers(q, s.reattach_grace_s), "r", offset, count)


async def test_an_abandoned_attempt_gives_what_it_sent_up_to_the_next_ones_start_and_never_an_end() -> None:
    q = MemoryQueue()
    await attempts_of(q)
    reading = attachment(q, offset=1)
    first, second = await reading.records()
    read = await q.read_events("r") + [("9-0", ev(4, 14, end=True))]  # even a terminal event of it
    got = list(reading.abandoned(first, second, read))
    assert [(e.index, e.token_ids, e.terminal) for e in got] == [(1, (11,), False), (2, (12,), False)]
    # A step's text goes with its last token: 10-11's with 11, 12-13's with 13 (the next attempt's).
    assert [e.text for e in got] == ["<10><11>", ""]


async def test_an_attach_through_the_attempts_is_contiguous_from_any_offset_and_ends_once() -> None:
    q = MemoryQueue()
    await attempts_of(q)
    for offset in range(7):
        got = [e async for _head, e in attachment(q, offset).events()]
        sent = [e for e in got if e.token_ids]
        assert [t for e in sent for t in e.token_ids] == [10, 11, 12, 13, 14, 15][offset:]
        at = offset
        for e in sent:
            assert e.index == at
            at += len(e.token_ids)
        assert [e.terminal for e in got].count(True) == 1 and got[-1].terminal
        assert got[-1].finished is not None and got[-1].finished.usage.completion_tokens == 6
    with pytest.raises(errors.OutOfRange, match=r"offset 7 .* ended after 6 tokens"):
        [e async for _head, e in attachment(q, 7).events()]
    with pytest.raises(errors.NotFound):
        [e async for _head, e in Attachment(q, Liveness(q, GatewaySettings()), DetachTimers(q, 1), "x").events()]


async def test_a_counted_attach_dropped_again_detaches_the_request_again() -> None:
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    await q.end("r", ev(0, 10))
    timers = DetachTimers(q, 3600)
    stream = Attachment(q, Liveness(q, GatewaySettings()), timers, "r", 0, count=True).events()
    assert (await anext(stream))[1].token_ids == (10,)
    await stream.aclose()  # the caller went away again, before the end
    assert await q.attach_count("r") == 1 and len(timers.tasks) == 1
    await timers.close()


async def test_an_attached_request_whose_worker_died_says_what_the_caller_can_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its worker's death ended the attempt, which only its gateway can move on (at once), and nothing
    did within the short wait for that (not the long one for a worker carrying it on): the Attach
    tells its caller to Attach again, or to send it again."""
    monkeypatch.setattr(liveness, "MOVE_WAIT_S", 0.2)
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    await q.end("r", ev(0, 10))
    died = errors.WorkerDied("the worker running it died")
    await q.end("r", JobEvent(index=1, failed=Failure(died.code, died.message)))
    with pytest.raises(errors.WorkerDied, match="Attach again") as exc:
        await asyncio.wait_for(read_all(attachment(q, wait_s=600)), 10)
    assert exc.value.running and exc.value.message.startswith("the worker running it died;")


async def test_an_attach_whose_worker_died_goes_on_with_the_attempt_its_gateway_moved_it_to() -> None:
    """The gateway that accepted the request moves it to another worker while an Attach follows it
    elsewhere: the Attach waits for that and delivers the rest, every token once."""
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    for e in (ev(0, 10, 11), ev(2, 12, 13)):
        await q.end("r", e)
    died = errors.WorkerDied("the worker running it died")
    await q.end("r", JobEvent(index=4, failed=Failure(died.code, died.message)))
    reading = attachment(q, wait_s=30).events()
    got = [(await anext(reading))[1]]
    while sum(len(e.token_ids) for e in got) < 4:  # what queued up unread may come joined
        got.append((await anext(reading))[1])
    rest = asyncio.create_task(anext(reading))
    await asyncio.sleep(0)  # (not a wait for time: the task runs up to its own wait)
    await q.begin("r", Attempt("r~1", 3, "cpu", "tiny", 1, True), first=False)
    for e in (ev(0, 13), ev(1, 14, 15, end=True)):
        await q.end("r~1", e)
    got.append((await asyncio.wait_for(rest, 10))[1])
    got += [e async for _head, e in reading]
    assert [t for e in got for t in e.token_ids] == [10, 11, 12, 13, 14, 15]
    indexes = [i for e in got for i in range(e.index, e.index + len(e.token_ids))]
    assert indexes == list(range(6)) and got[-1].terminal and sum(e.terminal for e in got) == 1


async def test_an_attempt_cancelled_by_the_gateway_that_moved_it_is_not_the_callers_end() -> None:
    """The attempt an Attach follows ends CANCELLED because its gateway moved the request (a worker
    carrying it on saw the attempt's cancel flag): the Attach goes on with the later attempt."""
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    await q.end("r", ev(0, 10, 11))
    reading = attachment(q).events()
    got = [(await anext(reading))[1]]  # following "r", its last attempt then
    await q.begin("r", Attempt("r~1", 2, "cpu", "tiny", 1, True), first=False)
    await q.end("r~1", ev(0, 12, 13, end=True))
    await q.end("r", JobEvent(index=2, finished=Finished(FinishReason.CANCELLED, Usage(1, 2))))
    got += [e async for _head, e in reading]
    assert [t for e in got for t in e.token_ids] == [10, 11, 12, 13]
    assert got[-1].finished is not None and got[-1].finished.finish_reason is FinishReason.LENGTH


def by(worker: str, e: JobEvent) -> JobEvent:
    return replace(e, worker=worker)


async def test_an_attach_waits_through_a_hand_back_for_the_worker_that_carries_it_on() -> None:
    """Its worker handed the request back (a drain): the Attach waits, and goes on once the stream
    moves again, even when the worker carrying it on has the same name (restarted under it)."""
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    await q.end("r", by("w1", ev(0, 10, 11)))
    await q.end("r", JobEvent(worker="w1", handed_back=True))
    got: list[JobEvent] = []
    rest = asyncio.create_task(read_into(attachment(q, wait_s=30), got))
    await until(lambda: got, 5, "the tokens before the hand-back")
    await q.end("r", by("w1", ev(2, 12)))  # not an end: only the stream growing says it went on
    await until(lambda: len(got) > 1, 5, "the carried-on token")
    await q.end("r", by("w1", ev(3, 13, end=True)))
    await asyncio.wait_for(rest, 10)
    assert [t for e in got for t in e.token_ids] == [10, 11, 12, 13] and sum(e.terminal for e in got) == 1
    assert not any(e.handed_back for e in got)
    # read again afterwards: the hand-back the stream went on after is passed at once
    again = await asyncio.wait_for(read_all(attachment(q, wait_s=30)), 10)
    assert [t for e in again for t in e.token_ids] == [10, 11, 12, 13] and again[-1].terminal


async def read_into(reading: Attachment, got: list[JobEvent]) -> None:
    async for _head, e in reading.events():
        got.append(e)


async def test_a_cancel_of_a_queued_later_attempt_ends_the_request_at_the_tokens_its_caller_has() -> None:
    """The request lost its first attempt after 5 tokens and its second is still queued when its
    caller cancels: the end the relay writes is numbered as that attempt's worker would number it,
    so every reader says 5 tokens (not 10), and an offset past them is out of range."""
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    await q.end("r", ev(0, 10, 11, 12, 13, 14))
    await q.begin("r", Attempt("r~1", 5, "cpu", "tiny", 1, True), first=False)
    relay = QueueRelay(q, GatewaySettings(reattach_grace_s=3600))
    try:
        await relay.cancel("r")
        got = await read_all(attachment(q))
        assert [t for e in got for t in e.token_ids] == [10, 11, 12, 13, 14]
        end = got[-1].finished
        assert end is not None and end.finish_reason is FinishReason.CANCELLED, got[-1]
        assert (got[-1].index, end.usage.completion_tokens) == (5, 5)
        with pytest.raises(errors.OutOfRange):
            await read_all(attachment(q, offset=7))
    finally:
        await relay.close()


async def test_a_dropped_attach_never_cancels_a_request_another_reader_still_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resumable request's detach timer cancels it only when nobody reads it at its end: a second
    Attach (an observer, or a caller's re-attach made before its first stream was seen to break)
    that goes away leaves the request to the reader still there; once that one goes too, it is."""
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, True), first=True)
    await q.end("r", ev(0, 10))
    cancelled: list[str] = []

    async def cancel(job_id: str) -> None:
        cancelled.append(job_id)

    monkeypatch.setattr(q, "cancel", cancel)
    timers = DetachTimers(q, 0.05)
    # the caller's stream (as a retried Generate follows it) and a second, counted Attach
    caller = Attachment(q, Liveness(q, GatewaySettings()), timers, "r", 0, count=False).events()
    other = Attachment(q, Liveness(q, GatewaySettings()), timers, "r", 0, count=True).events()
    for stream in (caller, other):
        assert (await anext(stream))[1].token_ids == (10,)
    await other.aclose()  # the other reader goes away
    (timer,) = timers.tasks
    await asyncio.wait_for(asyncio.shield(timer), 5)
    assert cancelled == []
    await caller.aclose()  # the caller goes away too: its relay starts the timer
    await timers.start("r", "r")
    await until(lambda: cancelled == ["r"], 5, "the detach timer to cancel the request nobody reads")
    await timers.close()


async def test_an_offset_past_a_sample_that_ended_in_an_earlier_attempt_is_out_of_range() -> None:
    """n = 2: sample 0 ended in the first attempt after 3 tokens, sample 1 in the second. An Attach
    asking for sample 0 from token 9 is refused before anything is sent, as for sample 1."""
    q = MemoryQueue()
    await q.begin("r", Attempt("r", 0, "cpu", "tiny", 1, bases=(0, 0)), first=True)
    await q.end("r", JobEvent(sample=0, token_ids=(1, 2, 3), sample_end=FinishReason.LENGTH))
    await q.end("r", JobEvent(sample=1, token_ids=(4,)))
    await q.begin("r", Attempt("r~1", 4, "cpu", "tiny", 1, bases=(3, 1), ended=(0,)), first=False)
    await q.end("r~1", JobEvent(sample=1, token_ids=(5, 6), finished=Finished(FinishReason.LENGTH, Usage(3, 2))))
    live = Liveness(q, GatewaySettings())
    for offsets, field in (
        ((9, 0), r"sample_offsets\[0\] 9 .* ended after 3 tokens"),
        ((0, 9), r"sample_offsets\[1\]"),
    ):
        with pytest.raises(errors.OutOfRange, match=field):
            await read_all(Attachment(q, live, DetachTimers(q, 1), "r", sample_offsets=offsets))
    whole = await read_all(Attachment(q, live, DetachTimers(q, 1), "r", sample_offsets=(3, 3)))
    assert [e.token_ids for e in whole if e.token_ids] == [] and whole[-1].terminal
