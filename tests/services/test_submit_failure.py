"""A Generate whose job could not be queued (Redis unreachable after its attempt was recorded) is
retried by its caller under the same request id: the retry runs, it does not follow a job that
was never queued."""

from __future__ import annotations

import grpc
import pytest

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.types import GenerationRequest
from llamamesh.v1 import generation_pb2 as pb
from tests.services.conftest import Config, Stack

pytestmark = pytest.mark.timeout(30)


class FailsOnce(MemoryQueue):
    """The fake queue, whose first submission fails as an unreachable Redis does."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        if not self.failed:
            self.failed = True
            raise QueueUnavailable("the queue is unreachable")
        await super().submit(pool, request, max_waiting, weight)


STACK = Config(
    gateway=GatewaySettings(port=0, models="tiny=cpu"),
    workers=(WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=4, heartbeat_s=0.05, consumer="w1"),),
    queue=FailsOnce,
)


async def test_a_retry_after_a_failed_submission_runs_instead_of_waiting_on_nothing(stack: Stack) -> None:
    """The first try recorded its attempt, then could not queue the job: UNAVAILABLE. The caller's
    retry with the same request id is queued and completes, rather than follow a job never queued
    until its deadline."""
    request = pb.GenerateRequest(request_id="again", prompt="hi", max_tokens=3)
    with pytest.raises(grpc.aio.AioRpcError) as first:
        [m async for m in stack.stub.Generate(request, timeout=10)]
    assert first.value.code() == grpc.StatusCode.UNAVAILABLE
    msgs = [m async for m in stack.stub.Generate(request, timeout=10)]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [i for m in msgs for i in range(m.index, m.index + len(m.token_ids))] == [0, 1, 2]
