"""Redis's outages as the gateway's view of its pools sees them: whether the queue is out (or
refuses writes) now, and whether a failure may be its doing rather than a backend's.

Redis being unreachable is nobody's failure: probes and requests that fail while it is out (or
within ``liveness_grace_s`` of its return) record nothing against any breaker. A Redis that
answers but refuses writes (full at its maxmemory: no heartbeat can be written) counts the same.
"""

from __future__ import annotations

from collections.abc import Callable


class QueueOutage:
    """What the users of the queue (the health check, probes, requests) last saw of it."""

    def __init__(self, grace_s: float, clock: Callable[[], float]) -> None:
        self._grace_s = grace_s
        self._clock = clock
        # When the queue was last seen unreachable (monotonic), by anyone: None while it answers
        # since start. ``down``: it is out now.
        self._down_at: float | None = None
        self.down = False
        self.writes_refused = False  # (the health check's write probe: Redis full)

    def saw_queue(self, reachable: bool) -> None:
        """What a user of the queue just saw."""
        if not reachable:
            self._down_at = self._clock()
        self.down = not reachable

    def saw_writes(self, accepted: bool) -> None:
        """Whether Redis took the health check's write: refused, it is out for writes (heartbeats
        too), though it answers reads."""
        if not accepted:
            self._down_at = self._clock()
        self.writes_refused = not accepted

    def troubled(self, since: float | None = None) -> bool:
        """The queue is out (or refuses writes), was out after ``since``, or came back less than the
        grace ago: a failure now may be its doing, not the backend's."""
        if self.down or self.writes_refused:
            return True
        if self._down_at is None:
            return False
        recent = self._clock() - self._down_at < self._grace_s
        return recent or (since is not None and self._down_at >= since)
