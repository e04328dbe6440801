"""Durable batches' settings: limits, lifetimes, and their share of the workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamamesh.settings.schema import FRACTION, Range, Section, setting

Admission = Literal["adaptive", "static"]


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
    """Most bytes of one BatchGenerate request; past it: INVALID_ARGUMENT naming this setting. The gRPC transport
    takes at most the larger of this and LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES, plus 1 MiB: a message larger still is
    refused by gRPC itself (RESOURCE_EXHAUSTED "Received message larger than max", no details), unread."""

    max_share: float = setting(0.5, FRACTION)
    """Fraction of a worker's max_inflight that batch items may hold at most (the rest stays free for interactive
    requests)."""

    min_share: float = setting(0.1, FRACTION)
    """Fraction of a worker's max_inflight that batch items get at least, even while interactive work queues."""

    admission: Admission = "adaptive"
    """How many slots batch items get between min_share and max_share. "adaptive": each worker follows its
    interactive requests' time to first token (acceptance to first token) in windows of adapt_interval_s: the
    window's 90th percentile over the target cuts the allowance to 0.7 of itself, under it grows the allowance by a
    tenth of the range; and batch items start paced, not as a cohort. "static": max_share whenever there is batch
    work."""

    interactive_ttft_target_s: float = setting(0.0, Range(0))
    """adaptive: the interactive time to first token (90th percentile of a window) batch items must leave alone.
    0: target_ratio times the worker's own baseline, the value measured while batch items held no more than
    min_share of its slots."""

    target_ratio: float = setting(1.2, Range(1))
    """adaptive with interactive_ttft_target_s 0: the target as a multiple of the baseline."""

    adapt_interval_s: float = setting(1.0, Range(above=0))
    """adaptive: seconds of each window of interactive first tokens the allowance reacts to (a window is judged once
    32 have come, or after four of these)."""

    claim_idle_s: float = setting(30.0, Range(above=0))
    """Seconds a leased item may go untouched (its worker died) before another worker takes it over; running items
    are touched every heartbeat."""

    fail_after: int = setting(50, Range(0))
    """A batch whose first this-many results all errored (none succeeded) fails: its unstarted items end cancelled
    instead of running. 0: never."""

    sweep_interval_s: float = setting(5.0, Range(above=0))
    """Seconds between a gateway's looks for batches past their deadline (their unstarted items end expired even
    while no worker runs)."""
