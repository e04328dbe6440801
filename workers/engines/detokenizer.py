"""Incremental detokenisation (:class:`IncrementalDetokenizer`) and stop strings
(:class:`StopStrings`), over any tokenizer with a ``decode`` method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas, with the prefix-offset / read-offset technique
    of TGI and vLLM: decode a short window of recent tokens and emit only what the newest tokens
    added, never while the window's text ends in U+FFFD (a multi-byte character still missing bytes).
    The concatenation of everything it emits, flush included, equals ``decode(all ids)``."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # Tokens [prefix_offset, read_offset) were emitted already and give the next tokens their context.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def seed(self, token_ids: Sequence[int]) -> str:
        """Take ``token_ids`` as already generated (a resumed sequence): they give the next tokens their
        context, and their text is not emitted again, bar a last character they leave incomplete (the
        run that generated them held it back; it comes with the tokens that complete it). Returns the
        text they were emitted as."""
        self._ids.extend(token_ids)
        read = len(self._ids)
        while read > 0 and self._decode(self._ids[max(0, read - 6) : read]).endswith(REPLACEMENT_CHAR):
            read -= 1
        self._read_offset = read
        self._prefix_offset = max(0, read - 6)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : read])
        return self._decode(self._ids[:read])

    def push(self, token_ids: int | Sequence[int]) -> str:
        """Add tokens; return the text they complete ("" while a character is still incomplete)."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

    def flush(self) -> str:
        """The text not emitted yet, incomplete characters included (as U+FFFD); call once, at the end."""
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = text[len(self._prefix_text) :]
        self._prefix_text = ""
        return delta


class StopStrings:
    """Finds stop strings in streamed text; emitted text never contains one, nor follows one. The text
    is cut at the first stop string, and any tail that could still grow into one is held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped: str | None = None

    @property
    def held(self) -> str:
        return self._held

    def prime(self, text: str) -> None:
        """Take ``text`` as streamed already (a resumed sequence's, past its min_tokens): hold back its
        tail that could begin a stop string, as the run that streamed it did. That tail is emitted with
        what follows, and a stop string across the resume point is found."""
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold :] if hold else ""

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """Add streamed text; return ``(text safe to emit, whether a stop string was found)``.

        With ``check=False`` (min_tokens not reached yet) nothing is searched or held back.
        After a stop string was found, everything is dropped.
        """
        if self.stopped is not None:
            return "", True
        buf = self._held + text
        self._held = ""
        if not check or not self._stops:
            return buf, False
        hit = -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (hit == -1 or at < hit):
                hit, self.stopped = at, stop
        if hit != -1:
            return buf[:hit], True
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text (the stream ended without completing a stop string)."""
        if self.stopped is not None:
            return ""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
