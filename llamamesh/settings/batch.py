"""Durable batches' settings: limits, lifetimes, and their share of the workers."""

from __future__ import annotations

from dataclasses import dataclass

from llamamesh.settings.schema import FRACTION, Range, Section, setting


@dataclass(frozen=True)
class BatchSettings(Section, section="batch"):
    """Durable batches (BatchService): limits, lifetimes, and their share of the workers."""

    completion_window_s: int = setting(86400, Range(1))
    """Seconds after submission in which items must start (a request may ask for less or more)."""

    retention_s: int = setting(7 * 86400, Range(0))
    """Seconds results (and the batch's record) are kept after the batch ends."""

    max_items: int = setting(50_000, Range(1))
    """Most items in one batch."""

    max_bytes: int = setting(64 * 1024 * 1024, Range(1))
    """Most bytes of one BatchGenerate request."""

    max_share: float = setting(0.5, FRACTION)
    """Fraction of a worker's max_inflight that batch items may hold at most (the rest stays free for interactive
    requests)."""

    min_share: float = setting(0.1, FRACTION)
    """Fraction of a worker's max_inflight that batch items get at least, even while interactive work queues."""

    claim_idle_s: float = setting(30.0, Range(above=0))
    """Seconds a leased item may go untouched (its worker died) before another worker takes it over; running items
    are touched every heartbeat."""

    fail_after: int = setting(50, Range(0))
    """A batch whose first this-many results all errored (none succeeded) fails: its unstarted items end cancelled
    instead of running. 0: never."""

    sweep_interval_s: float = setting(5.0, Range(above=0))
    """Seconds between a gateway's looks for batches past their deadline (their unstarted items end expired even
    while no worker runs)."""
