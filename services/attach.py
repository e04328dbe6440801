"""An Attach's reading of a request by its id, from the tokens the caller has: through its attempts
in order, what each abandoned attempt had sent (up to where the next one began), then the last one
followed to its end, every event cut to what the caller has not got (services/cursor.py).

A counted Attach (a caller re-attaching, not a retried Generate following its own request) stops
the request's detach timer; one that is dropped again detaches it again, with the same grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import replace

import structlog

from llamamesh import errors
from llamamesh.queue.protocol import RelayQueue
from llamamesh.types import Attempt, FinishReason, GenerationRequest, JobEvent, public_id
from services.attempts import handed_back, raise_failure
from services.cursor import SampleCursors, window
from services.detach import DetachTimers
from services.liveness import Liveness

log = structlog.get_logger(__name__)

LOST_WHILE_ATTACHED = (
    "it did not go on elsewhere in time (a request is moved to another worker by the gateway that accepted it "
    "while that gateway follows it, or carried on by the worker that reclaims its job): Attach again, or send it again"
)


class _Moved(Exception):
    """The followed attempt was abandoned for a later one: read the attempts again."""


def _cancelled(ev: JobEvent) -> bool:
    return ev.finished is not None and ev.finished.finish_reason is FinishReason.CANCELLED


def check_in_range(request_id: str, end: JobEvent, base: int, offset: int, n: int) -> None:
    """Raise OutOfRange when an Attach asked for tokens past the end of what the request (or
    sample) produced: ``end`` ends it, after ``base`` tokens of earlier attempts."""
    past_end(request_id, end.sample, base + end.index + len(end.token_ids), offset, n)


def past_end(request_id: str, sample: int, produced: int, offset: int, n: int) -> None:
    """Raise OutOfRange when ``offset`` is past the ``produced`` tokens of an ended ``sample``."""
    if offset > produced:
        field, what = ("offset", "request") if n == 1 else (f"sample_offsets[{sample}]", f"sample {sample}")
        raise errors.OutOfRange(
            f"{field} {offset} is past the end of request {public_id(request_id)!r}: its {what} ended after "
            f"{produced} tokens"
        )


class Attachment:
    """One reading of request ``request_id`` from token ``offset`` (n > 1: from ``sample_offsets``,
    and ``offset`` must be 0). ``count``: a re-attach (it stops a detach timer)."""

    def __init__(
        self,
        queue: RelayQueue,
        liveness: Liveness,
        timers: DetachTimers,
        request_id: str,
        offset: int = 0,
        count: bool = True,
        sample_offsets: Sequence[int] = (),
    ) -> None:
        self._queue = queue
        self._liveness = liveness
        self._timers = timers
        self.request_id = request_id
        self._offset = offset
        self._count = count
        self._sample_offsets = tuple(sample_offsets)
        self.streams = SampleCursors(1)  # set from the request's first attempt by ``records``

    async def events(self) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        """The events the caller has not got, each with the request as first accepted (id, model,
        acceptance time: what its responses echo), to the end. Raises NotFound for an unknown (or
        expired) id, InvalidRequest for an offset given for a request of several samples,
        OutOfRange for one past its end, and the error of a failure event."""
        records = await self.records()
        if self.streams.n > 1 and any(self._sample_offsets):  # (one sample: nothing is sent before its end)
            await self._check_ended(records[-1])
        if self._count:
            await self._queue.attach(self.request_id)
            log.info(
                "request_attached",
                request_id=self.request_id,
                offset=self._offset,
                sample_offsets=list(self._sample_offsets),
            )
        reader = records[-1].resumable  # one of its readers while this reads (a detach timer waits for none)
        try:
            if reader:  # (whole even if cancelled meanwhile: ``went`` below always balances it)
                await asyncio.shield(self._timers.came(self.request_id))
            while True:
                try:
                    async for item in self._through(records):
                        yield item
                    return
                except _Moved:
                    records = await self._queue.attempts(self.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            if self._count and records[-1].resumable:  # dropped again: the same grace as the first time
                await asyncio.shield(self._timers.start(self.request_id, records[-1].attempt_id))
            raise
        finally:
            if reader:
                await asyncio.shield(self._timers.went(self.request_id))

    async def _through(self, records: list[Attempt]) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        """Every attempt in ``records``: what each abandoned one sent, then the last one followed."""
        for i, rec in enumerate(records):
            head = GenerationRequest(request_id=self.request_id, model=rec.model, accepted_unix_ns=rec.accepted_unix_ns)
            if i + 1 < len(records):
                for ev in self.abandoned(rec, records[i + 1], await self._queue.read_events(rec.attempt_id)):
                    yield head, ev
                continue
            async with aclosing(self.followed(rec, len(records))) as events:
                async for ev in events:
                    yield head, ev

    async def records(self) -> list[Attempt]:
        """The request's attempts; the cursors of what the caller has of it are set from the first."""
        records = await self._queue.attempts(self.request_id)
        if not records:
            raise errors.NotFound(f"no request {public_id(self.request_id)!r} (unknown, or its events expired)")
        n = max(len(records[0].bases), 1)
        if n > 1 and self._offset:
            raise errors.InvalidRequest.field(
                "offset", f"this request has {n} samples: give what you have of each in sample_offsets"
            )
        if len(self._sample_offsets) > n:
            raise errors.InvalidRequest.field(
                "sample_offsets", f"{len(self._sample_offsets)} entries; this request has {n} sample(s)"
            )
        offsets = list(self._sample_offsets) if n > 1 else [self._offset or next(iter(self._sample_offsets), 0)]
        self.streams = SampleCursors(n, offsets)
        return records

    async def _check_ended(self, last: Attempt) -> None:
        """When the request has ended (its last attempt ``last`` did), raise OutOfRange for an offset
        past the end of any sample before anything is sent: a sample's tokens are not sent ahead of
        another's refusal."""
        read = await self._queue.read_events(last.attempt_id)
        if not read or not read[-1][1].terminal:
            return
        for k in last.ended:  # samples that ended in earlier attempts: their base is all they made
            if (cursor := self.streams.cursors.get(k)) is not None:
                past_end(self.request_id, k, last.base_of(k), cursor.next, self.streams.n)
        for _id, ev in read:
            cursor = self.streams.cursors.get(ev.sample)
            if cursor is not None and ev.ends_sample is not None:
                check_in_range(self.request_id, ev, last.base_of(ev.sample), cursor.next, self.streams.n)

    def abandoned(self, rec: Attempt, later: Attempt, read: list[tuple[str, JobEvent]]) -> Iterator[JobEvent]:
        """What attempt ``rec`` (abandoned for ``later``) sent that the caller has not got, up to where
        ``later`` began: its events ``read``, renumbered, cut, never terminal."""
        streams = self.streams
        for _id, ev in read:
            k = ev.sample
            # A sample's end counts only if the next attempt knew it had ended.
            ev = replace(ev, finished=None, failed=None, sample_end=ev.ends_sample if k in later.ended else None)
            cursor = streams.cursors.get(k)
            part = window(ev, rec.base_of(k), cursor.next, later.base_of(k)) if cursor else None
            if part is not None and (part := streams.accept(part)) is not None:
                yield part

    async def followed(self, rec: Attempt, attempts: int = 1) -> AsyncGenerator[JobEvent, None]:
        """The last attempt ``rec`` (of ``attempts``) followed to its end (its worker's liveness
        watched), renumbered and cut to what the caller has not got. When its worker is lost, it waits
        for the request to go on (``Liveness.went_on``): moved to a later attempt (raises _Moved), or
        carried on in place (followed again from what the caller has)."""
        passed = 0  # hand-backs the stream went on after (a worker carried it on)
        while True:
            lost, ended, seen = "", False, 0
            try:
                async with aclosing(self._liveness.watched(rec.pool, rec.attempt_id)) as events:
                    async for ev in events:
                        lost = ev.worker or lost
                        if ev.handed_back:
                            seen += 1
                            if seen > passed:
                                raise handed_back(ev)
                            continue
                        ended = ev.failed is not None
                        raise_failure(ev)
                        if _cancelled(ev) and len(await self._queue.attempts(self.request_id)) > attempts:
                            raise _Moved  # cancelled by the gateway that moved it, not by its caller
                        part = self._part(rec, ev)
                        if part is not None:
                            yield part
                return
            except (errors.WorkerLost, errors.EngineDead) as exc:
                went = await self._liveness.went_on(self.request_id, rec.attempt_id, attempts, "" if ended else lost)
                if went == "moved":
                    raise _Moved from exc
                if not went:
                    raise type(exc)(f"{exc.message}; {LOST_WHILE_ATTACHED}") from exc
                log.info("attached_request_carried_on", request_id=self.request_id, lost=lost)
                passed = seen

    def _part(self, rec: Attempt, ev: JobEvent) -> JobEvent | None:
        """``ev`` of attempt ``rec`` as the caller numbers it, less what it has (None: nothing)."""
        streams = self.streams
        cursor = streams.cursors.get(ev.sample)
        if cursor is not None and ev.ends_sample is not None:
            check_in_range(self.request_id, ev, rec.base_of(ev.sample), cursor.next, streams.n)
        part = window(ev, rec.base_of(ev.sample), cursor.next if cursor else 0, None, rec.base)
        return None if part is None else streams.accept(part)
