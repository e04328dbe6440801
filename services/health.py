"""grpc.health.v1 for the server and each public service, driven by the queue's reachability."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog
from grpc_health.v1 import health, health_pb2

from llamamesh import metrics
from llamamesh.errors import QueueOutOfMemory, QueueUnavailable
from llamamesh.loop import cancel_and_wait
from llamamesh.queue.protocol import QueueState
from llamamesh.settings import GatewaySettings

log = structlog.get_logger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


LIVENESS = "llamamesh.liveness"
# SERVING while Redis takes writes; NOT_SERVING while it is full (maxmemory) or refuses them otherwise.
QUEUE_WRITES = "llamamesh.queue"
# Seconds between checks of a queue that did not answer the last one.
OUTAGE_CHECK_S = 0.2
# Seconds between checks of Redis's eviction policy (a managed Redis's may change under it).
EVICTION_CHECK_S = 60.0


class HealthReporter:
    """Owns the health servicer and the task that pings the queue every ``interval_s``.

    - ``llamamesh.liveness``: SERVING while the process runs (liveness: restart me if not).
    - The server ("") and each service in ``services``: readiness, SERVING while the queue answers
      (and for ``unreachable_hold_s`` after it stopped answering, so that a Redis blip does not take
      every gateway out of its load balancer at the same moment), NOT_SERVING otherwise and after
      ``shutdown()``.
    - ``llamamesh.backend.<pool>`` for each backend pool: SERVING while the queue answers and the
      pool has a live worker and its breaker is not open (``set_backend``, fed by services/backends.py).
    - ``llamamesh.queue``: SERVING while Redis takes writes (a write probe each check); NOT_SERVING
      while it refuses them, e.g. full at its maxmemory (``llamamesh_queue_full`` is then 1). Readiness
      stays SERVING then: the gateway still streams, attaches, cancels and reads batches, and every
      new request is refused RESOURCE_EXHAUSTED saying why, which a gateway taken out of its load
      balancer could not tell its callers.

    Redis that comes back without its data (the queue's epoch changed: a restart without
    persistence, a failover to an empty replica) is not run against silently: readiness is
    NOT_SERVING for ``data_loss_hold_s``, ``data_losses`` counts it (open streams watch it and end
    UNAVAILABLE), then the new data is adopted.

    While the queue does not answer it is checked every ``OUTAGE_CHECK_S`` instead, so that readiness
    comes back within a fraction of a second of Redis; ``watch`` callbacks hear every check.
    """

    def __init__(
        self,
        queue: QueueState,
        services: Sequence[str],
        interval_s: float = 2.0,
        data_loss_hold_s: float = 10.0,
        unreachable_hold_s: float = 0.0,
    ) -> None:
        self.servicer = health.aio.HealthServicer()
        self._queue = queue
        self._hold_s = data_loss_hold_s
        self._unreachable_hold_s = unreachable_hold_s
        self._down_since: float | None = None  # when the queue stopped answering
        self._epoch = ""
        self._held_until = 0.0
        self.data_losses = 0
        self._names = ["", *services]
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._serving: bool | None = None
        self.reachable = True
        self._backends: dict[str, bool] = {}
        self._watchers: list[Callable[[bool], None]] = []
        self._write_watchers: list[Callable[[bool], None]] = []
        self.writable: bool | None = None
        # The eviction policy Redis was last found to have ("": it evicts nothing), and when (monotonic).
        self.evicts = ""
        self._eviction_checked = -EVICTION_CHECK_S

    @classmethod
    def for_gateway(cls, queue: QueueState, services: Sequence[str], settings: GatewaySettings) -> HealthReporter:
        """The gateway's: its check interval and both holds from its settings."""
        hold = (settings.data_loss_hold_s, settings.unreachable_hold_s)
        return cls(queue, services, settings.health_interval_s, *hold)

    def watch(self, seen: Callable[[bool], None]) -> None:
        """Call ``seen(reachable)`` after every check of the queue."""
        self._watchers.append(seen)

    def watch_writes(self, seen: Callable[[bool], None]) -> None:
        """Call ``seen(writable)`` after every check of whether the queue takes writes."""
        self._write_watchers.append(seen)

    async def _set(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        for name in self._names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)
        for name, up in self._backends.items():
            await self.servicer.set(name, SERVING if serving and up else NOT_SERVING)
        log.info("health_changed", serving=serving)

    async def set_backend(self, service: str, serving: bool) -> None:
        self._backends[service] = serving
        await self.servicer.set(service, SERVING if serving and self._serving else NOT_SERVING)

    async def check_now(self) -> None:
        try:
            epoch = await asyncio.wait_for(self._queue.epoch(), timeout=self._interval_s)
        except (QueueUnavailable, asyncio.TimeoutError) as exc:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                hold_s = self._unreachable_hold_s if self._serving else 0
                why = exc.detail if isinstance(exc, QueueUnavailable) else "no answer"
                log.warning("queue_unreachable", error=why, readiness_hold_s=hold_s)
            self._saw(False)
            if not (self._serving and now - self._down_since < self._unreachable_hold_s):
                await self._set(False)
            if self.writable is not None:  # unknown until it answers again (no write to judge)
                await self.servicer.set(QUEUE_WRITES, NOT_SERVING)
                self.writable = None
            return
        self._saw(True)
        self._down_since = None
        if self._epoch and epoch != self._epoch:
            self.data_losses += 1
            self._held_until = time.monotonic() + self._hold_s
            log.error(
                "redis_data_lost",
                hold_s=self._hold_s,
                detail="Redis answers without the queue's data: open requests end UNAVAILABLE",
            )
        self._epoch = epoch
        await self._set(time.monotonic() >= self._held_until)
        await self._check_writes()
        await self._check_eviction()

    async def _check_eviction(self) -> None:
        """Every EVICTION_CHECK_S: whether Redis would evict keys at its maxmemory (jobs, events and results would
        be lost): the gauge, and an error logged once per policy found."""
        now = time.monotonic()
        if now - self._eviction_checked < EVICTION_CHECK_S:
            return
        try:
            policy = await asyncio.wait_for(self._queue.eviction(), timeout=self._interval_s)
        except (QueueUnavailable, asyncio.TimeoutError):
            return
        self._eviction_checked = now
        metrics.QUEUE_EVICTING.set(1 if policy else 0)
        if policy and policy != self.evicts:
            log.error(
                "redis_may_evict",
                policy=policy,
                detail="at its maxmemory Redis would evict the queue's keys (jobs, token streams, batch results): "
                "set maxmemory-policy noeviction",
            )
        self.evicts = policy

    async def _check_writes(self) -> None:
        full, why = False, ""
        try:
            await asyncio.wait_for(self._queue.check_writes(), timeout=self._interval_s)
        except QueueOutOfMemory as exc:
            full, why = True, exc.message
        except (QueueUnavailable, asyncio.TimeoutError) as exc:
            why = str(exc) or "no answer"
        writable = not why
        metrics.QUEUE_FULL.set(1 if full else 0)
        for seen in self._write_watchers:
            seen(writable)
        if writable != self.writable:
            await self.servicer.set(QUEUE_WRITES, SERVING if writable else NOT_SERVING)
            if not writable:
                log.error("queue_writes_refused", full=full, detail=why)
            elif self.writable is False:
                log.info("queue_writes_accepted")
        self.writable = writable

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, SERVING)
        await self.check_now()
        self._task = asyncio.create_task(self._loop(), name="health")

    def _saw(self, reachable: bool) -> None:
        self.reachable = reachable
        for seen in self._watchers:
            seen(reachable)

    async def _loop(self) -> None:
        while self._task is not None:  # None once shutdown began (a cancel swallowed by wait_for ends it too)
            await asyncio.sleep(self._interval_s if self.reachable else min(self._interval_s, OUTAGE_CHECK_S))
            await self.check_now()

    def queue_generation(self) -> int:
        """Changes when Redis lost its data: a request submitted under another one is gone."""
        return self.data_losses

    async def shutdown(self) -> None:
        """Report NOT_SERVING for good and stop probing."""
        if (task := self._task) is not None:
            self._task = None
            await cancel_and_wait(task)
        await self.servicer.enter_graceful_shutdown()
