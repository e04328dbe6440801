"""Readiness through a Redis blip (services/health.py): it stays SERVING for ``unreachable_hold_s``
while the queue does not answer, then turns NOT_SERVING until it answers again; and a Redis that would
evict keys is said."""

from __future__ import annotations

import pytest
import structlog
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from llamamesh.errors import QueueUnavailable
from services.health import HealthReporter
from tests.waiting import until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Flaky:
    """A QueueState that answers while ``up``."""

    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.evicts = ""

    def _check(self) -> None:
        if not self.up:
            raise QueueUnavailable("connection refused")

    async def ping(self) -> None:
        self._check()

    async def epoch(self) -> str:
        self._check()
        return "epoch-1"

    async def check_writes(self) -> None:
        self._check()

    async def eviction(self) -> str:
        self._check()
        return self.evicts

    async def close(self) -> None:
        pass


async def status(reporter: HealthReporter, service: str = "") -> int:
    response = await reporter.servicer.Check(health_pb2.HealthCheckRequest(service=service), None)
    return int(response.status)


async def test_readiness_holds_through_a_blip_shorter_than_the_hold() -> None:
    queue = Flaky()
    reporter = HealthReporter(queue, ["svc"], interval_s=0.05, unreachable_hold_s=0.5)
    await reporter.start()
    try:
        assert await status(reporter) == SERVING
        queue.up = False
        await reporter.check_now()
        assert not reporter.reachable
        assert await status(reporter) == SERVING and await status(reporter, "svc") == SERVING
        await until(
            lambda: status(reporter), 5, "readiness NOT_SERVING after the hold", done=lambda s: s == NOT_SERVING
        )
        assert await status(reporter, "svc") == NOT_SERVING
        queue.up = True
        await until(lambda: status(reporter), 5, "readiness back once Redis answers", done=lambda s: s == SERVING)
        # A new outage starts a new hold.
        queue.up = False
        await reporter.check_now()
        assert await status(reporter) == SERVING
    finally:
        await reporter.shutdown()


async def test_without_a_hold_readiness_follows_the_first_failed_check() -> None:
    queue = Flaky()
    reporter = HealthReporter(queue, [], interval_s=10, unreachable_hold_s=0)
    await reporter.start()
    try:
        queue.up = False
        await reporter.check_now()
        assert await status(reporter) == NOT_SERVING
    finally:
        await reporter.shutdown()


async def test_a_gateway_that_never_reached_redis_is_not_ready() -> None:
    reporter = HealthReporter(Flaky(up=False), [], interval_s=10, unreachable_hold_s=60)
    await reporter.start()
    try:
        assert await status(reporter) == NOT_SERVING
    finally:
        await reporter.shutdown()


async def test_a_redis_that_would_evict_keys_is_said_once_and_gauged() -> None:
    queue = Flaky()
    queue.evicts = "volatile-lru"  # a managed Redis's default: event streams and results have TTLs
    reporter = HealthReporter(queue, [], interval_s=10)
    with structlog.testing.capture_logs() as logs:
        await reporter.start()
        await reporter.check_now()  # (checked again only after EVICTION_CHECK_S)
    try:
        said = [e for e in logs if e["event"] == "redis_may_evict"]
        assert len(said) == 1 and said[0]["policy"] == "volatile-lru" and "noeviction" in said[0]["detail"]
        assert REGISTRY.get_sample_value("llamamesh_queue_evicting") == 1
        assert await status(reporter) == SERVING  # said, not refused: the queue still works
    finally:
        await reporter.shutdown()
    queue.evicts = ""
    fixed = HealthReporter(queue, [], interval_s=10)
    await fixed.start()
    await fixed.shutdown()
    assert REGISTRY.get_sample_value("llamamesh_queue_evicting") == 0
