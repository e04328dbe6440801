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
from llamamesh.types import Attempt, GenerationRequest, JobEvent, public_id
from services.attempts import raise_failure
from services.cursor import SampleCursors, window
from services.detach import DetachTimers
from services.liveness import Liveness

log = structlog.get_logger(__name__)

LOST_WHILE_ATTACHED = (
    "A request is moved to another worker by the gateway that accepted it while it follows it: "
    "Attach again to go on with it; one whose gateway was gone or whose caller had left it ends here "
    "(send it again)"
)


def check_in_range(request_id: str, end: JobEvent, base: int, offset: int, n: int) -> None:
    """Raise OutOfRange when an Attach asked for tokens past the end of what the request (or
    sample) produced: ``end`` ends it, after ``base`` tokens of earlier attempts."""
    produced = base + end.index + len(end.token_ids)
    if offset > produced:
        field, what = ("offset", "request") if n == 1 else (f"sample_offsets[{end.sample}]", f"sample {end.sample}")
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
        if self._count:
            await self._queue.attach(self.request_id)
            log.info(
                "request_attached",
                request_id=self.request_id,
                offset=self._offset,
                sample_offsets=list(self._sample_offsets),
            )
        try:
            for i, rec in enumerate(records):
                head = GenerationRequest(
                    request_id=self.request_id, model=rec.model, accepted_unix_ns=rec.accepted_unix_ns
                )
                if i + 1 < len(records):
                    for ev in self.abandoned(rec, records[i + 1], await self._queue.read_events(rec.attempt_id)):
                        yield head, ev
                    continue
                async with aclosing(self.followed(rec)) as events:
                    async for ev in events:
                        yield head, ev
        except (asyncio.CancelledError, GeneratorExit):
            if self._count and records[-1].resumable:  # dropped again: the same grace as the first time
                await asyncio.shield(self._timers.start(self.request_id, records[-1].attempt_id))
            raise

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

    async def followed(self, rec: Attempt) -> AsyncGenerator[JobEvent, None]:
        """The last attempt ``rec`` followed to its end (its worker's liveness watched), renumbered
        and cut to what the caller has not got."""
        streams = self.streams
        try:
            async with aclosing(self._liveness.watched(rec.pool, rec.attempt_id)) as events:
                async for ev in events:
                    raise_failure(ev)
                    cursor = streams.cursors.get(ev.sample)
                    if cursor is not None and ev.ends_sample is not None:
                        check_in_range(self.request_id, ev, rec.base_of(ev.sample), cursor.next, streams.n)
                    part = window(ev, rec.base_of(ev.sample), cursor.next if cursor else 0, None, rec.base)
                    if part is not None and (part := streams.accept(part)) is not None:
                        yield part
        except (errors.WorkerLost, errors.EngineDead) as exc:
            # Only the gateway that accepted the request moves it to another worker, and only while
            # it follows it (its caller connected there): say what the caller can do.
            raise type(exc)(f"{exc.message}. {LOST_WHILE_ATTACHED}") from exc
