"""The gateway routes by the configured rules: in-process gateway, in-memory queue, one fake-engine
worker per pool."""

from __future__ import annotations

import pytest

from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.types import GenerationRequest, SamplingParams
from llamamesh.v1 import generation_pb2 as pb
from services.relay import resumed
from services.server import start_gateway
from tests.services.conftest import Config, Stack

pytestmark = pytest.mark.timeout(30)


POOLS = ("cpu", "fast", "gold")
STACK = Config(
    gateway=GatewaySettings(port=0, models="tiny=cpu", routes="temperature == 0 -> fast; meta.tier == gold -> gold"),
    workers=tuple(WorkerSettings(pool=pool, model="tiny", engine="fake", consumer=f"w-{pool}") for pool in POOLS),
)


async def test_requests_go_where_the_rules_say(stack: Stack) -> None:
    engines = dict(zip(POOLS, stack.running.engines, strict=True))
    cases = {
        "greedy": (pb.GenerateRequest(request_id="greedy", prompt="a b", max_tokens=2, temperature=0.0), "fast"),
        "sampled": (pb.GenerateRequest(request_id="sampled", prompt="a b", max_tokens=2, temperature=0.7), "cpu"),
        "gold": (pb.GenerateRequest(request_id="gold", prompt="a b", max_tokens=2, metadata={"tier": "gold"}), "gold"),
    }
    for rid, (request, pool) in cases.items():
        msgs = [m async for m in stack.stub.Generate(request)]
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert [p for p, e in engines.items() if rid in e.served] == [pool], rid


async def test_a_bad_rule_stops_the_gateway_from_starting() -> None:
    with pytest.raises(ValueError, match="unknown field 'temp'"):
        await start_gateway(MemoryQueue(), GatewaySettings(port=0, models="tiny=cpu", routes="temp == 0 -> x"), port=0)


def test_a_resumed_attempt_asks_for_the_rest_only() -> None:
    req = GenerationRequest(
        request_id="r", model="m", prompt="p", sampling=SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0)
    )
    again = resumed(req, 1, [])
    assert again.request_id == "r~1" and again.resume_token_ids == () and again.sampling == req.sampling
    later = resumed(req, 2, [5, 6, 7, 8, 9, 10])
    assert later.request_id == "r~2" and later.resume_token_ids == (5, 6, 7, 8, 9, 10)
    assert later.sampling.max_tokens == 4 and later.sampling.min_tokens == 0 and later.sampling.temperature == 0.0
