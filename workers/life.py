"""A worker's state as its heartbeat tells it (starting, ready, failed, with why and since when),
whether its engine died or wedged, and the wake-ups its loops wait on."""

from __future__ import annotations

import asyncio
import math
import time

from llamamesh.errors import EngineDead
from llamamesh.types import WorkerState


class Life:
    """Shared by the worker's parts (leasing, heartbeat, watchdog, in-flight jobs); one event loop."""

    def __init__(self) -> None:
        self.state = WorkerState.STARTING
        self.detail = ""
        self.since = time.time()
        # Set when the engine could not start, died or wedged, or the event writer failed: the worker
        # stops leasing and exits non-zero.
        self.engine_died: EngineDead | None = None
        # The engine stopped making progress (or the event writer failed): the worker leaves without
        # draining, its heartbeat withdrawn at once.
        self.wedged = False
        # A slot freed, or the engine died: wakes the lease loop.
        self.slot_free = asyncio.Event()
        # The event writer failed: cuts a drain short.
        self.writer_failed = asyncio.Event()
        # When (monotonic) Redis last failed to answer this worker: no worker could touch its jobs
        # meanwhile, so none is reclaimed until a round of heartbeats has touched them again.
        self.unreachable_at = -math.inf

    def unreachable(self) -> None:
        """Redis did not answer one of the worker's calls."""
        self.unreachable_at = time.monotonic()

    def set(self, state: WorkerState, detail: str = "") -> None:
        self.state, self.detail, self.since = state, detail, time.time()

    def fail(self, dead: EngineDead, wedged: bool = False) -> None:
        """The engine is gone (``wedged``: without draining): state FAILED with why, the lease loop woken."""
        self.engine_died = dead
        self.wedged = self.wedged or wedged
        self.set(WorkerState.FAILED, dead.message)
        self.slot_free.set()
