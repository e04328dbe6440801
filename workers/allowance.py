"""How many of a worker's slots batch items may hold now, and when the next one may start
(:class:`BatchAllowance`).

Adaptive admission is additive increase, multiplicative decrease on the worker's interactive time to
first token (from the gateway's acceptance to the engine's first token): each window (at least
``adapt_interval_s``, judged once it holds VERDICT_SAMPLES first tokens or WINDOWS_AT_MOST
intervals passed) has its 90th percentile held against the target; missed, the allowance is cut to
DECREASE of itself (not below ``min_share`` of the slots); met, or with no interactive request, it
grows by a tenth of the range (not above ``max_share``). Without a target of its own the worker
learns one: a baseline from the windows in which batch items held no more than the floor, times
``target_ratio``; a worker that has none yet, with interactive requests and batch items above the
floor, goes down to the floor to measure it. The gateway's and the worker's clocks both count in the
signal: keep them synchronised (NTP), as tracing needs anyway.

Batch items then start paced: at the rate that keeps the allowance's slots busy for items of the
length seen so far, not all together as the slots free, so that a cohort of batch prompts does not
fill one engine step (an interactive request arriving then would wait for all of their prefill).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import structlog

from llamamesh import metrics
from llamamesh.settings import BatchSettings

log = structlog.get_logger(__name__)

DECREASE = 0.7
# Windows from the floor to the ceiling while the target is met.
INCREASE_STEPS = 10
# A window is judged once it has this many interactive first tokens (a 90th percentile of fewer is
# mostly noise), or at the latest after WINDOWS_AT_MOST intervals with MIN_SAMPLES or more; fewer
# than that, or none after one interval, count as met.
VERDICT_SAMPLES = 32
WINDOWS_AT_MOST = 4
MIN_SAMPLES = 8
# Weight of each new floor window in the baseline (an exponential moving average).
BASELINE_WEIGHT = 0.25
# Of the batch items' mean length: the pace lets through this much more than it takes to keep the
# slots busy, so the allowance (not the pace) bounds the items in flight.
PACE_HEADROOM = 1.25
SAMPLES_KEPT = 4096
LEASE_ROUND_S = 0.1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class BatchAllowance:
    """The batch items' slots of one worker with ``slots`` in all. Static admission: ``max_share``
    of them always, started as they free. Not thread-safe: the worker's event loop owns it."""

    def __init__(
        self, batch: BatchSettings, slots: int, pool: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ceiling = max(1, int(slots * batch.max_share))
        self.floor = min(self.ceiling, math.ceil(slots * batch.min_share))
        self.adaptive = batch.admission == "adaptive"
        self._target_s = batch.interactive_ttft_target_s
        self._ratio = batch.target_ratio
        self._interval_s = batch.adapt_interval_s
        self._clock = clock
        # Adaptive starts at the floor (and grows within a few windows when nothing interactive runs).
        self.value = float(self.floor if self.adaptive else self.ceiling)
        self.baseline_s: float | None = None
        self.signal_s: float | None = None  # the last judged window's 90th percentile
        self._samples: list[float] = []
        self._peak = 0  # the most batch items in flight during the window
        self._window_start = clock()
        self._item_s: float | None = None  # the batch items' mean length so far
        self._credit = 1.0  # batch starts the pace allows now
        self._credited_at = clock()
        self._gauges = (
            metrics.BATCH_ALLOWANCE.labels(pool),
            metrics.INTERACTIVE_TTFT_SIGNAL.labels(pool),
            metrics.INTERACTIVE_TTFT_TARGET.labels(pool),
        )
        self._gauges[0].set(int(self.value))

    @property
    def target_s(self) -> float | None:
        if self._target_s:
            return self._target_s
        return None if self.baseline_s is None else self.baseline_s * self._ratio

    def first_token(self, ttft_s: float) -> None:
        """An interactive request's time from acceptance to its first token."""
        if self.adaptive and len(self._samples) < SAMPLES_KEPT:
            self._samples.append(max(0.0, ttft_s))

    def item_done(self, ran_s: float) -> None:
        """A batch item ended after ``ran_s`` seconds in this worker."""
        self._item_s = ran_s if self._item_s is None else 0.9 * self._item_s + 0.1 * ran_s

    def slots(self, running: int) -> int:
        """The batch items this worker may hold now, ``running`` of them running."""
        if self.adaptive:
            self._peak = max(self._peak, running)
            age = self._clock() - self._window_start
            n = len(self._samples)
            if age >= self._interval_s and (not n or n >= VERDICT_SAMPLES or age >= WINDOWS_AT_MOST * self._interval_s):
                self._judge()
        return int(self.value)

    def startable(self, wanted: int) -> int:
        """How many of ``wanted`` batch items the pace lets start now (:meth:`started` takes them)."""
        if not self.adaptive or self._item_s is None or wanted <= 0:
            return max(0, wanted)
        now = self._clock()
        rate = self._rate()
        # At most a lease round's pace (the loop leases at least every 100 ms) starts at once.
        burst = max(1.0, rate * LEASE_ROUND_S)
        self._credit = min(burst, self._credit + (now - self._credited_at) * rate)
        self._credited_at = now
        return min(wanted, int(self._credit))

    def started(self, count: int) -> None:
        """``count`` batch items started (leased new)."""
        if self.adaptive and self._item_s is not None:
            self._credit = max(0.0, self._credit - count)

    def _rate(self) -> float:
        """Batch starts a second that keep ``value`` slots busy with items of the mean length."""
        return PACE_HEADROOM * max(1.0, self.value) / max(self._item_s or 0.0, 1e-3)

    def _judge(self) -> None:
        """The window that just ended: decrease when its interactive first tokens missed the
        target, else increase; a window at the floor feeds the baseline."""
        samples, peak = self._samples, self._peak
        self._samples, self._peak = [], 0
        self._window_start = self._clock()
        step = max(1.0, (self.ceiling - self.floor) / INCREASE_STEPS)
        if len(samples) < MIN_SAMPLES:
            self.value = min(float(self.ceiling), self.value + step)
        else:
            p90 = self.signal_s = percentile(samples, 90)
            if peak <= self.floor:
                b = self.baseline_s
                self.baseline_s = p90 if b is None else (1 - BASELINE_WEIGHT) * b + BASELINE_WEIGHT * p90
            target = self.target_s
            if target is None and peak > self.floor:  # no baseline yet: measure one at the floor
                self.value = float(self.floor)
            elif target is not None and p90 > target:
                self.value = max(float(self.floor), math.floor(self.value * DECREASE))
            else:
                self.value = min(float(self.ceiling), self.value + step)
        log.debug(
            "batch_allowance_judged",
            slots=int(self.value),
            samples=len(samples),
            p90_ms=None if self.signal_s is None else round(self.signal_s * 1e3, 1),
            target_ms=None if self.target_s is None else round(self.target_s * 1e3, 1),
            batch_peak=peak,
        )
        allowance, signal, target_gauge = self._gauges
        allowance.set(int(self.value))
        if self.signal_s is not None:
            signal.set(self.signal_s)
        if self.target_s is not None:
            target_gauge.set(self.target_s)
