"""What generation yields: an engine's token deltas, the events of a request's stream, and how a
request ends (finished with its usage, or failed as data)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """What an engine yields: the text and tokens of one step for one request.

    The last delta of a stream has ``finish_reason`` set and ``prompt_tokens``
    filled in. ``text`` never ends inside a multi-byte character. It may also carry the engine's own
    timings of the request (name, milliseconds), which the worker logs with the job.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    engine_timings_ms: tuple[tuple[str, float], ...] = ()
    # Of the prompt's tokens, those the engine's prefix cache held (None: the engine does not say).
    cached_tokens: int | None = None
    # Which of the request's n samples it belongs to; its finish_reason ends that sample only (the
    # stream ends after every sample ended, or at the first CANCELLED).
    sample: int = 0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Of the prompt tokens, those served from the engine's prefix cache (0: none, or not reported).
    cached_tokens: int = 0


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    started_unix_ns: int = 0
    first_token_unix_ns: int = 0


@dataclass(frozen=True)
class Failure:
    """A failure as data: what crosses Redis instead of an exception."""

    code: str
    message: str
    retryable: bool = False
    field: str = ""


@dataclass(frozen=True)
class JobEvent:
    """One entry of a request's event stream (token deltas of one engine step).

    At most one of ``finished`` / ``failed`` is set, on the last event only.
    ``tokenized`` marks the last event of a tokenize job; ``handed_back`` the last one of a worker
    that gave the job up unfinished (never joined with another). With n > 1 samples, ``sample`` says whose
    tokens these are (``index`` counts within that sample), and ``sample_end`` ends a sample that is
    not the last one to end; the terminal event's ``finished`` ends the last one (its sample) and
    counts every sample's tokens.

    ``marks`` keeps, for events joined into this one (``then``, ``joined``), where each but the
    last ended: (tokens, characters of ``text``) so far. It lets a reader cut the event at any of
    those token counts with the text that goes with each side (``text_before``). It does not cross
    Redis: a worker's event is one engine step (or what its writer merged), and a caller's count of
    tokens received always falls on such a boundary.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: Finished | None = None
    failed: Failure | None = None
    tokenized: bool = False
    worker: str = ""
    sample: int = 0
    sample_end: FinishReason | None = None
    # The last event its worker writes for a job it gave up unfinished (a drain out of grace, a
    # withdrawal, a dead engine): not terminal; the job stays leased for another worker to carry on
    # (workers/carry_on.py). ``engine_died``: given up because the engine died under it.
    handed_back: bool = False
    engine_died: bool = False
    marks: tuple[tuple[int, int], ...] = ()

    @property
    def terminal(self) -> bool:
        return self.finished is not None or self.failed is not None or self.tokenized

    @property
    def last_of_worker(self) -> bool:
        """Whether its worker writes nothing more for the job: it ended it, or handed it back."""
        return self.terminal or self.handed_back

    @property
    def ends_sample(self) -> FinishReason | None:
        """How this event ends its sample, if it does."""
        if self.sample_end is not None:
            return self.sample_end
        return self.finished.finish_reason if self.finished is not None else None

    def follows_on(self, later: JobEvent) -> bool:
        """``later`` (of the same sample, this one not ending it) starts where this event's tokens
        end (or carries none): the two can be one."""
        if later.sample != self.sample or self.sample_end is not None or self.handed_back or later.handed_back:
            return False
        if self.worker and later.worker and later.worker != self.worker:
            return False  # a stream another worker carried on: a reader counts the switch
        return not later.token_ids or later.index == self.index + len(self.token_ids)

    def then(self, later: JobEvent) -> JobEvent:
        """This event and the next one of the same request as one: the deltas joined, the ending (if
        any) and worker of ``later``, the index of this one. ``later`` must follow on (ValueError)."""
        return JobEvent.joined((self, later))

    @staticmethod
    def joined(events: Sequence[JobEvent]) -> JobEvent:
        """Events of one request, each following on the one before, as one (``then`` over all of
        them, in one pass rather than one copy per event). ValueError if one does not follow on."""
        first, last = events[0], events[-1]
        if len(events) == 1:
            return first
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        marks: list[tuple[int, int]] = []
        chars = 0
        for i, ev in enumerate(events):
            if i:
                prev = events[i - 1]
                if not prev.follows_on(ev):
                    end = prev.index + len(prev.token_ids)
                    raise ValueError(f"an event at token {ev.index} does not follow on one that ends at {end}")
                marks.append((len(ids), chars))
            marks.extend((len(ids) + t, chars + c) for t, c in ev.marks)
            texts.append(ev.text)
            chars += len(ev.text)
            ids.extend(ev.token_ids)
            logprobs.extend(ev.logprobs)
        return replace(
            last,
            text="".join(texts),
            token_ids=tuple(ids),
            logprobs=tuple(logprobs),
            index=first.index,
            marks=tuple(marks),
        )

    def text_before(self, k: int) -> int:
        """How many characters of ``text`` go with the first ``k`` of ``token_ids``: the text of the
        joined events whose tokens all lie among them (``marks``). Text with no token of its own (a
        final flush) goes with what follows it, and an engine step's text with its last token, so
        the two sides of any cut add up to the whole text."""
        if k >= len(self.token_ids) and not self.marks:
            return len(self.text) if k else 0
        best_t = chars = 0
        for t, c in (*self.marks, (len(self.token_ids), len(self.text))):
            if t > k:
                break
            if t > best_t:
                best_t, chars = t, c
        return chars
