"""What the gateway knows of one backend pool (``Pool``): its workers as their heartbeats say, its
circuit breaker, when it went empty or began starting, its recent queue wait and token rate."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llamamesh.types import WorkerStatus
from services.breaker import Breaker, State


class TokenRate:
    """Tokens per second over the last ``window_s`` whole seconds: one counter per second in a ring,
    so that counting an event is an integer add (and a clock read)."""

    def __init__(self, clock: Callable[[], float], window_s: int = 5) -> None:
        self._clock = clock
        self._window = window_s
        self._second = [-1] * (window_s + 1)  # the second each slot counts (the current one too)
        self._tokens = [0] * (window_s + 1)

    def add(self, tokens: int) -> None:
        now = int(self._clock())
        i = now % len(self._second)
        if self._second[i] != now:
            self._second[i], self._tokens[i] = now, 0
        self._tokens[i] += tokens

    def per_s(self) -> float:
        """The mean over the last ``window_s`` whole seconds (the current one is not over yet)."""
        now = int(self._clock())
        n = sum(t for s, t in zip(self._second, self._tokens, strict=True) if now - self._window <= s < now)
        return n / self._window


@dataclass
class Pool:
    name: str
    breaker: Breaker
    workers: tuple[WorkerStatus, ...] = ()
    probes: int = 0
    last_probe_error: str = ""
    # Monotonic time since when the pool has had no worker ready or starting (set at start and on
    # every loss), and since when it has had starting workers and none ready.
    empty_since: float = 0.0
    starting_since: float = 0.0
    # The last read of its heartbeats failed (Redis out).
    unreachable: bool = False
    # Monotonic time until which workers known before an outage are kept though their heartbeats
    # are missing (they expired while Redis was out; each gets a round to come back).
    kept_until: float = 0.0
    # Its breaker opened only because it had no live worker (no probe of a worker failed): workers
    # that arrive close it outright, so a burst after a (re)start is served, not refused half-open.
    opened_empty: bool = False
    # The ready workers it had when it last lost its last one (their heartbeats stopped: hung, cut off or killed),
    # by name and since when they were ready: one of them back without a restart (ready since the same time, where
    # a restart keeping its name starts anew) is tried half-open, as after failures.
    vanished: frozenset[tuple[str, float]] = frozenset()
    ever_live: bool = False
    # Recent queue wait (accepted -> a worker started it), an exponential average, its samples, and
    # when the last was taken (clock time).
    queue_wait_s: float = 0.0
    waits: int = 0
    wait_seen_at: float = 0.0
    # Its jobs queued and not leased by any worker, at the last probe.
    waiting: int = 0
    # Tokens relayed to callers from this pool (services/relayed.py), per second of late.
    tokens: TokenRate = field(default_factory=lambda: TokenRate(time.monotonic))

    @property
    def live(self) -> bool:
        """A worker is ready to serve."""
        return any(w.ready for w in self.workers)

    @property
    def starting(self) -> bool:
        """No worker is ready, and one is starting: the pool is coming up."""
        return not self.live and any(w.starting for w in self.workers)

    @property
    def present(self) -> bool:
        return self.live or self.starting

    def what_is_wrong(self) -> str:
        """What its workers say, for an error message: the starting ones' progress, the failed ones' reasons."""
        parts = [
            f"worker {w.worker} is {w.state}" + (f": {w.detail}" if w.detail else "")
            for w in self.workers
            if not w.ready
        ][:3]
        return "; ".join(parts)

    def has_room(self) -> bool:
        """No job was waiting at the last probe and a ready worker had a free slot at its last
        heartbeat: a new request need not queue."""
        return not self.waiting and any(w.ready and w.inflight < w.max_inflight for w in self.workers)

    def usable(self) -> bool:
        return self.live and self.breaker.available()

    def serving(self) -> bool:
        return self.live and self.breaker.state is not State.OPEN
