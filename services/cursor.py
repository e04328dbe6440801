"""The stream invariant: every token index reaches the caller exactly once and in order. ``Cursor``
holds it for one stream (``SampleCursors`` for each sample of a request), across merged reads,
failovers, re-attaches and Redis restarts. Also the renumbering and cutting of events: ``shifted``
(an event of a resumed attempt as the caller's stream numbers it), ``cut`` (an event cut to a range
of tokens, with the text that goes with them) and ``window`` (both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import structlog

from llamamesh import errors
from llamamesh.types import JobEvent, Usage

log = structlog.get_logger(__name__)


def shifted(ev: JobEvent, base: int, first_token_ns: int = 0, usage_base: int | None = None) -> JobEvent:
    """An event of a resumed attempt as the caller's stream numbers it: ``base`` tokens of its sample
    came before (``usage_base``: of every sample; default ``base``)."""
    f = ev.finished
    if f is not None:
        before = base if usage_base is None else usage_base
        f = replace(
            f,
            usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens + before),
            first_token_unix_ns=first_token_ns or f.first_token_unix_ns,
        )
    return replace(ev, index=ev.index + base, finished=f)


def cut(ev: JobEvent, offset: int, end: int | None) -> JobEvent | None:
    """``ev`` (numbered as the caller's stream) cut to tokens [offset, end), with the text that goes
    with them (``JobEvent.text_before``: the pieces of any cuts add up to the whole text): None if
    nothing of it is left (a terminal event always stays, with what is left of its tokens and
    text)."""
    start, stop = ev.index, ev.index + len(ev.token_ids)
    lo, hi = max(start, offset), stop if end is None else min(stop, end)
    if hi <= lo and not (ev.terminal or ev.sample_end is not None):
        return None
    whole = end is None or end > stop  # text after the last token (a final flush) goes with what follows
    if lo == start and hi == stop and whole:
        return ev
    hi = max(lo, hi)
    a, b = lo - start, hi - start
    ca = ev.text_before(a)
    text = ev.text[ca : len(ev.text) if whole else ev.text_before(b)]
    marks = tuple((t - a, c - ca) for t, c in ev.marks if a < t < b)
    return replace(ev, index=lo, token_ids=ev.token_ids[a:b], text=text, logprobs=ev.logprobs[a:b], marks=marks)


def window(ev: JobEvent, base: int, offset: int, end: int | None, usage_base: int | None = None) -> JobEvent | None:
    """``ev`` of an attempt that started at token ``base`` (of its sample), numbered as the caller's
    stream and cut to tokens [offset, end)."""
    return cut(shifted(ev, base, usage_base=usage_base) if base or usage_base else ev, offset, end)


class Cursor:
    """The stream invariant for one caller: ``accept`` passes each token index once, in order. An
    event that repeats tokens the caller has (a publish the worker retried after a lost reply: the
    first try was applied) is dropped and counted (``duplicates_dropped``); one that starts past them
    is a gap (Redis came back without its last writes) and raises EventsLost.

    Workers' publish retries are therefore safe to repeat: the reader drops by index what it has,
    rather than each writer choosing entry ids (an entry id the writer picks would have to sort after
    the ``*`` ids the gateway writes into the same stream, e.g. Cancel's terminal event)."""

    duplicates_dropped = 0  # every cursor's, for the process (tests and logs read it)

    def __init__(self, sent: list[int] | None = None, offset: int = 0) -> None:
        self.sent = sent if sent is not None else []
        self.offset = offset  # the caller has tokens [0, offset) from elsewhere (an Attach)

    @property
    def next(self) -> int:
        return self.offset + len(self.sent)

    def accept(self, ev: JobEvent) -> JobEvent | None:
        """``ev`` (numbered as the caller's stream) less what the caller has; None if that is
        nothing. Raises EventsLost when it starts past the next index."""
        if ev.token_ids and ev.index > self.next:
            raise errors.EventsLost(
                f"the queue lost tokens {self.next}..{ev.index - 1} of this stream; retry the request"
            )
        if ev.token_ids and ev.index < self.next:
            Cursor.duplicates_dropped += 1
            log.warning("duplicate_tokens_dropped", index=ev.index, tokens=len(ev.token_ids), next=self.next)
            part = cut(ev, self.next, None)
            if part is None:
                return None
            ev = part
        self.sent.extend(ev.token_ids)
        return ev


class SampleCursors:
    """The stream invariant for each sample of one caller's request (one for n == 1), and which
    samples have ended."""

    def __init__(self, n: int, offsets: Sequence[int] = ()) -> None:
        self.n = n
        self.cursors = {k: Cursor(offset=offsets[k] if k < len(offsets) else 0) for k in range(n)}
        self.ended: set[int] = set()
        self._only = self.cursors[0] if n == 1 else None  # the common case, on every event

    @property
    def total(self) -> int:
        """Tokens sent to the caller, every sample's."""
        if self._only is not None:
            return len(self._only.sent)
        return sum(len(c.sent) for c in self.cursors.values())

    def bases(self) -> tuple[int, ...]:
        """Tokens of each sample the caller has (an Attempt record's ``bases``), for n > 1."""
        return tuple(len(c.sent) for c in self.cursors.values()) if self.n > 1 else ()

    def accept(self, ev: JobEvent) -> JobEvent | None:
        """``ev`` (numbered as the caller's stream of its sample) less what the caller has; None if
        that is nothing. An end of a sample that already ended (a retried publish) is dropped; raises
        EventsLost for a gap, or for a sample this request does not have."""
        cursor = self._only if self._only is not None and not ev.sample else self.cursors.get(ev.sample)
        if cursor is None:
            raise errors.EventsLost(f"an event of sample {ev.sample} in a request of {self.n} sample(s)")
        if ev.sample_end is not None and not ev.terminal and ev.sample in self.ended:
            return None
        part = cursor.accept(ev)
        if part is not None and (part.sample_end is not None or part.finished is not None):
            self.ended.add(ev.sample)
        return part
