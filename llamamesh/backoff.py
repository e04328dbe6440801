"""Jittered exponential delays, for everything that retries the queue while Redis is unreachable.

Every retry loop of the queue's users (the gateway's event reader, a worker's join, lease, publish
and batch results) waits through one ``Delays``: doubling from ``first_s`` up to ``cap_s``, each
delay multiplied by a random factor in [1 - jitter, 1 + jitter] so that a fleet of workers does not
retry in lockstep after a restart; ``reset()`` after a success. A short cap (half a second by
default) keeps the time from Redis's return to work flowing again well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable


class Delays:
    def __init__(
        self, first_s: float = 0.05, cap_s: float = 0.5, jitter: float = 0.25, rand: Callable[[], float] = random.random
    ) -> None:
        self.first_s, self.cap_s, self.jitter = first_s, cap_s, jitter
        self._rand = rand
        self._n = 0

    def next(self) -> float:
        """The next delay (and count one more failure)."""
        base = min(self.cap_s, self.first_s * 2**self._n)
        self._n += 1
        return base * (1 - self.jitter + 2 * self.jitter * self._rand())

    def reset(self) -> None:
        self._n = 0

    async def wait(self, stop: asyncio.Event | None = None) -> float:
        """Sleep the next delay (returning early once ``stop`` is set); returns the delay."""
        delay = self.next()
        if stop is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return delay
