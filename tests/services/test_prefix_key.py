"""Prefix affinity through the gateway: GenerateRequest.prefix_key (or a hash of the input's start)
reaches the job, and a worker leases it from the partition it owns (the fake queue's affinity)."""

from __future__ import annotations

import pytest

from llamamesh import metrics
from llamamesh.errors import FieldViolation, InvalidRequest
from llamamesh.queue.affinity import partition_of
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.types import ChatMessage, GenerationRequest, affinity_key
from llamamesh.v1 import generation_pb2 as pb
from services.convert import generate_request
from tests.services.conftest import Config, Stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)

MODELS = GatewaySettings(models="tiny=cpu").model_table()


class Recording(MemoryQueue):
    """The fake queue, keeping every submitted request."""

    def __init__(self, partitions: int) -> None:
        super().__init__(partitions=partitions)
        self.submitted: list[GenerationRequest] = []

    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        self.submitted.append(request)
        await super().submit(pool, request, max_waiting, weight)


def test_the_gateway_keys_a_request_by_its_prefix_key_or_its_inputs_start() -> None:
    s = GatewaySettings(affinity_prefix_chars=8)
    given, _m = generate_request(pb.GenerateRequest(prompt="hello", prefix_key="conv-1"), s, MODELS)
    assert given.prefix_key == "conv-1"
    a, _m = generate_request(pb.GenerateRequest(prompt="same start, then A"), s, MODELS)
    b, _m = generate_request(pb.GenerateRequest(prompt="same start, then B"), s, MODELS)
    assert a.prefix_key == b.prefix_key == affinity_key("same sta", None, 8) != ""
    chat = (ChatMessage("user", "hi"), ChatMessage("system", "be brief"))
    assert affinity_key(None, chat, 100) == affinity_key(None, tuple(reversed(chat)), 100)  # system first
    assert affinity_key("x", None, 0) == ""
    off, _m = generate_request(pb.GenerateRequest(prompt="x"), GatewaySettings(affinity_prefix_chars=0), MODELS)
    assert off.prefix_key == ""
    with pytest.raises(InvalidRequest) as bad:
        generate_request(pb.GenerateRequest(prompt="x", prefix_key="k" * 257), s, MODELS)
    assert [v.field for v in bad.value.violations] == ["prefix_key"] and isinstance(
        bad.value.violations[0], FieldViolation
    )


@pytest.mark.parametrize(
    "stack",
    [
        Config(
            gateway=GatewaySettings(port=0, models="tiny=cpu"),
            workers=(
                WorkerSettings(
                    pool="cpu", model="tiny", engine="fake", max_inflight=4, heartbeat_s=0.05, consumer="w1"
                ),
            ),
            queue=lambda: Recording(partitions=4),
        )
    ],
    indirect=True,
)
async def test_an_explicit_prefix_key_over_grpc_reaches_the_job_and_its_owners_partition(stack: Stack) -> None:
    queue = stack.queue
    assert isinstance(queue, Recording)
    own = metrics.AFFINITY_LEASES.labels("cpu", "own")
    await until(lambda: len(queue.owned("cpu", "w1")) == 4, 10, "w1's first heartbeat, owning every partition")
    stolen = metrics.AFFINITY_LEASES.labels("cpu", "stolen")
    before = own._value.get(), stolen._value.get()
    msgs = [m async for m in stack.stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, prefix_key="conv-7"))]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    (sent,) = queue.submitted
    assert sent.prefix_key == "conv-7" and partition_of(sent, 4) == partition_of(
        GenerationRequest(request_id="other", model="tiny", prefix_key="conv-7"), 4
    )
    after = own._value.get(), stolen._value.get()
    assert after == (before[0] + 1, before[1])  # from its own partition, not stolen
