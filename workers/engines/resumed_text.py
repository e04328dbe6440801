"""The text at a resumed request's failover point, on an engine library that applies stop strings
itself and streams a request's text a fixed number of characters behind its tokens while it has any
(vLLM: the longest stop string's length less one, so that no part of a stop string is ever sent).

The earlier attempt's caller therefore lacks the last characters of the resumed tokens' text. The
resumed run's library sees those tokens as prompt: it neither streams their text nor finds a stop
string that begins in it. :class:`ResumedText` does both: the held text goes with the resumed run's
first text, and a stop string across the failover point ends the run there, as it would have ended
the uninterrupted one. The caller's text stays the library's own invariant (the text of every token
it has, less the held characters), so a later failover of the resumed run is handled the same way.
Pure: testable without any library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from llamamesh.types import FinishReason, TokenDelta
from workers.engines.detokenizer import Decoder, IncrementalDetokenizer


class ResumedText:
    """One resumed request's deltas as its caller gets them. ``carried``: the tokens an earlier attempt
    generated; ``hold``: the characters the library streams behind its tokens; ``check``: whether
    stop strings apply at the failover point (min_tokens was reached before it)."""

    def __init__(
        self, tokenizer: Decoder, carried: Sequence[int], stops: Sequence[str], hold: int, *, check: bool
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        text = self._detok.seed(carried)  # a last character the tokens left incomplete is not in it
        self.held = text[max(0, len(text) - hold) :] if hold > 0 else ""
        self._stops = tuple(s for s in stops if s) if check else ()
        self._hold = hold
        self._new = ""  # the resumed run's text so far, decoded here (the library's is behind it)
        self._sent = 0  # of the held text
        self.open = bool(self.held)  # until the held text went out, or the run stopped
        self.stopped = False

    def feed(self, delta: TokenDelta) -> TokenDelta:
        """``delta`` of the resumed run as the caller gets it. The held text goes out as the library's
        own text would have: the caller has the text of every token it has but the last ``hold``
        characters (all of it with the library's first text, or at the end). A delta whose tokens
        complete a stop string across the failover point ends the run (``stopped``): its text ends
        before the stop string, its finish reason is STOP_SEQUENCE, and the library must then be told
        to stop the request."""
        if not self.open:
            return delta
        self._new += self._detok.push(delta.token_ids)
        at = self._across(self.held + self._new) if self._stops else None
        if at is not None:  # it begins after what went out: a stop that began there was complete then
            self.open, self.stopped = False, True
            return replace(delta, text=self.held[self._sent : at], finish_reason=FinishReason.STOP_SEQUENCE)
        n = len(self.held)
        upto = n if delta.text or delta.finish_reason is not None else min(n, max(0, len(self._new) - self._hold + n))
        text, self._sent = self.held[self._sent : upto], max(self._sent, upto)
        self.open = self._sent < n
        return replace(delta, text=text + delta.text) if text else delta

    def _across(self, text: str) -> int | None:
        """Where the first stop string that begins in the held text and ends after it begins."""
        n = len(self.held)
        found = [at for s in self._stops if -1 < (at := text.find(s, max(0, n - len(s) + 1))) < n]
        return min(found, default=None)
