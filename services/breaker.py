"""A circuit breaker per backend pool: closed -> open -> half-open -> closed.

Pure state and arithmetic over an injected clock (no I/O, no asyncio), so every transition is
tested exactly. What feeds it, and what counts as a failure, is the caller's (services/backends.py):
probe results, expired heartbeats, engine errors and timeouts of real requests, never client errors.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from llamamesh import metrics
from llamamesh.settings import BreakerSettings

log = structlog.get_logger(__name__)


class State(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Transition:
    at_unix_s: float
    old: State
    new: State
    reason: str


@dataclass
class Breaker:
    """One pool's breaker.

    - closed: everything passes. It opens after ``probe_failures`` consecutive failed probes (or a
      pool with no live worker, which the caller records as a failed probe), or when, over the last
      ``window`` real requests (at least ``min_requests`` of them), the failure rate reaches
      ``error_rate``.
    - open: nothing passes for ``open_s``; then the next ``allow`` turns it half-open (at once,
      through ``revive``, when a worker appears in a pool that had none).
    - half-open: at most ``half_open_max`` requests or probes are let through at a time; after
      ``half_open_successes`` successes in a row it closes, and one failure opens it again.
    """

    pool: str
    settings: BreakerSettings
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    state: State = State.CLOSED
    transitions: list[Transition] = field(default_factory=list)
    _probe_failures: int = 0
    _outcomes: deque[bool] = field(default_factory=deque)
    _opened_at: float = 0.0
    _in_flight: int = 0
    _successes: int = 0

    def _move(self, new: State, reason: str) -> None:
        old, self.state = self.state, new
        self.transitions.append(Transition(self.wall(), old, new, reason))
        del self.transitions[:-20]
        log.warning("breaker_transition", pool=self.pool, old=old.value, new=new.value, reason=reason)
        metrics.breaker_moved(self.pool, new.value)
        self._probe_failures = 0
        self._outcomes.clear()
        self._in_flight = 0
        self._successes = 0
        if new is State.OPEN:
            self._opened_at = self.clock()

    def allow(self) -> bool:
        """May one more request or probe go to this pool now? (A True in half-open takes a slot,
        which ``record`` gives back.)"""
        if self.state is State.OPEN:
            if self.clock() - self._opened_at < self.settings.open_s:
                return False
            self._move(State.HALF_OPEN, f"open for {self.settings.open_s:g} s")
        if self.state is State.HALF_OPEN:
            if self._in_flight >= self.settings.half_open_max:
                return False
            self._in_flight += 1
        return True

    def available(self) -> bool:
        """Would ``allow`` let something through now (without taking a slot)?"""
        if self.state is State.OPEN:
            return self.clock() - self._opened_at >= self.settings.open_s
        if self.state is State.HALF_OPEN:
            return self._in_flight < self.settings.half_open_max
        return True

    def revive(self, reason: str, close: bool = False) -> None:
        """What opened it is gone (a worker appeared in a pool that had none): try it now, half-open,
        instead of waiting out ``open_s``; ``close``: it opened only because the pool had no worker
        (nothing failed), so a burst of requests after a cold start is not refused."""
        if self.state is State.OPEN:
            self._move(State.CLOSED if close else State.HALF_OPEN, reason)

    def release(self) -> None:
        """Give back a half-open slot whose outcome says nothing about the backend."""
        self._in_flight = max(0, self._in_flight - 1)

    def record(self, ok: bool, probe: bool, reason: str = "") -> None:
        """The outcome of a probe or a real request that ``allow`` let through."""
        if self.state is State.HALF_OPEN:
            self._in_flight = max(0, self._in_flight - 1)
            if not ok:
                self._move(State.OPEN, f"failed while half-open: {reason}")
                return
            self._successes += 1
            if self._successes >= self.settings.half_open_successes:
                self._move(State.CLOSED, f"{self._successes} successes while half-open")
            return
        if self.state is State.OPEN:
            return  # a straggler from before it opened
        if probe:
            self._probe_failures = 0 if ok else self._probe_failures + 1
            if self._probe_failures >= self.settings.probe_failures:
                self._move(State.OPEN, f"{self._probe_failures} probes failed in a row: {reason}")
            return
        self._outcomes.append(ok)
        while len(self._outcomes) > self.settings.window:
            self._outcomes.popleft()
        failures, n = self._outcomes.count(False), len(self._outcomes)
        if n >= self.settings.min_requests and failures / n >= self.settings.error_rate:
            self._move(State.OPEN, f"{failures} of the last {len(self._outcomes)} requests failed: {reason}")
