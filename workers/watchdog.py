"""A worker's engine watchdog: every ``health_check_s`` it asks the engine ``check_health()`` and
watches its progress counter. A dead engine stops the worker (drain, exit 1); a wedged one (requests
in flight, no progress for ``wedge_timeout_s``, or no answer to its health check) makes it leave at
once without draining."""

from __future__ import annotations

import asyncio
import time

import structlog

from llamamesh.errors import EngineDead
from llamamesh.settings import WorkerSettings
from workers.engines.base import Engine
from workers.life import Life
from workers.samples import Samples
from workers.wakeups import any_set

log = structlog.get_logger(__name__)


class Watchdog:
    def __init__(self, settings: WorkerSettings, engine: Engine, samples: Samples, life: Life) -> None:
        self._s = settings
        self._engine = engine
        self._samples = samples
        self._life = life
        self._last_steps = 0
        self._moved = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        """Owned by the worker: check until ``stop`` or the engine's end (recorded in ``life``)."""
        self._last_steps, self._moved = self._engine.stats().steps, time.monotonic()
        while not stop.is_set() and self._life.engine_died is None:
            await any_set(stop, timeout=self._s.health_check_s)
            dead = await self._check_health() or self._check_progress()
            if dead is not None:
                self._life.fail(*dead)

    async def _check_health(self) -> tuple[EngineDead, bool] | None:
        """(why, wedged) when the engine says it is dead or does not answer."""
        s = self._s
        try:
            await asyncio.wait_for(self._engine.check_health(), max(s.health_check_s, 1.0))
        except EngineDead as exc:
            log.error("engine_unhealthy", error=exc.message)
            return exc, False
        except asyncio.TimeoutError:
            return EngineDead(f"the engine did not answer its health check in {s.health_check_s:g} s"), True
        return None

    def _check_progress(self) -> tuple[EngineDead, bool] | None:
        """(why, wedged) when the engine made no progress for ``wedge_timeout_s`` with requests in it
        (a job waiting on Redis to record its result is not the engine's)."""
        steps, now = self._engine.stats().steps, time.monotonic()
        inflight = self._samples.in_engine
        if steps != self._last_steps or not inflight or steps < 0:
            self._last_steps, self._moved = steps, now
            return None
        idle = now - self._moved
        if not self._s.wedge_timeout_s or idle <= self._s.wedge_timeout_s:
            return None
        log.error("engine_wedged", inflight=inflight, idle_s=round(idle, 1))
        why = f"the engine made no progress for {idle:.0f} s with {inflight} requests in flight"
        return EngineDead(why), True
