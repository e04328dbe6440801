"""What a starting node is doing, shown: on a terminal one line rewritten in place, elsewhere a line
per change, or with JSON logs a log event per change."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import IO

import structlog

log = structlog.get_logger(__name__)


class Progress:
    """What the node is doing, on a terminal as one line rewritten in place, elsewhere a line per change."""

    def __init__(self, out: IO[str] | None, t0: float, inline: bool = True, events: bool = False) -> None:
        self._out = out
        self._t0 = t0
        self._tty = inline and bool(out is not None and out.isatty()) and not events
        self._events = events  # log events (JSON logs) rather than lines of text
        self._last = ""
        self._width = 0

    def update(self, what: str, step: str) -> None:
        """Show ``what``; off a terminal only when ``step`` (``what`` without its timings) changed."""
        if self._events:
            if step != self._last:
                log.info("node_starting", step=step, elapsed_s=round(time.monotonic() - self._t0, 1))
            self._last = step
            return
        if self._out is None:
            return
        elapsed = f"[{time.monotonic() - self._t0:5.1f} s] "
        if self._tty:
            line = (elapsed + what)[: max(20, _columns() - 1)]
            self._out.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif step != self._last:
            self._out.write(elapsed + what + "\n")
        self._last = step
        self._out.flush()

    def done(self, what: str) -> None:
        if self._events:
            if what:
                log.info("node_status", message=what, elapsed_s=round(time.monotonic() - self._t0, 1))
            return
        if self._out is None:
            return
        if self._tty and self._width:
            self._out.write("\r" + " " * self._width + "\r")
        if what:
            self._out.write(f"[{time.monotonic() - self._t0:5.1f} s] {what}\n")
        self._out.flush()


def _columns() -> int:
    with contextlib.suppress(OSError):
        return os.get_terminal_size(sys.stderr.fileno()).columns
    return 100
