"""grpc.health.v1 for the server and each public service, driven by the queue's reachability."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog
from grpc_health.v1 import health, health_pb2

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.protocol import JobQueue

log = structlog.get_logger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthReporter:
    """Owns the health servicer and the task that pings the queue every ``interval_s``.

    The server ("") and each service in ``services`` are SERVING while the queue
    answers, NOT_SERVING otherwise and after ``shutdown()``.
    """

    def __init__(self, queue: JobQueue, services: Sequence[str], interval_s: float = 2.0) -> None:
        self.servicer = health.aio.HealthServicer()
        self._queue = queue
        self._names = ["", *services]
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._serving: bool | None = None

    async def _set(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        for name in self._names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)
        log.info("health_changed", serving=serving)

    async def check_now(self) -> None:
        try:
            await asyncio.wait_for(self._queue.ping(), timeout=self._interval_s)
            await self._set(True)
        except (QueueUnavailable, asyncio.TimeoutError):
            await self._set(False)

    async def start(self) -> None:
        await self.check_now()
        self._task = asyncio.create_task(self._loop(), name="health")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_now()

    async def shutdown(self) -> None:
        """Report NOT_SERVING for good and stop probing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.servicer.enter_graceful_shutdown()
