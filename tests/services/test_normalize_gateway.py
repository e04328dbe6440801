"""Prompt normalisation through the real gRPC gateway: what reaches the queue and the worker is the
rewritten text (the services stack: in-memory queue, a fake-engine worker)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import ChatMessage
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from services.server import start_gateway
from tests.services.conftest import Config, Stack

pytestmark = pytest.mark.timeout(30)

RULES = json.dumps(
    [
        {"name": "gw-html-ids", "pattern": 'id="[a-z0-9-]+"', "replacement": 'id="REDACTED"'},
        {
            "name": "gw-user-dates",
            "pattern": r"\d{4}-\d{2}-\d{2}",
            "replacement": "DATE",
            "applies_to": "messages",
            "roles": ["user"],
        },
    ]
)
SETTINGS = GatewaySettings(port=0, models="tiny=cpu", default_max_tokens=16, normalize_rules=RULES)
TABLE = 'Summarise:\n<table><tr id="r-7f3a9c"><td id="c-01b2">x</td></tr></table>'
REDACTED = 'Summarise:\n<table><tr id="REDACTED"><td id="REDACTED">x</td></tr></table>'


def rewrites(rule: str) -> float:
    return REGISTRY.get_sample_value("llamamesh_prompt_rewrites_total", {"rule": rule}) or 0.0


@pytest.fixture
async def normalizing(stack: Stack) -> AsyncIterator[pb_grpc.GenerationServiceStub]:
    """A gateway with the rules over the stack's queue (and its worker), beside the stack's plain one."""
    async with stack.beside(SETTINGS) as stub:
        yield stub


@pytest.mark.fake_step_s(0.02)
async def test_the_worker_gets_the_rewritten_prompt(stack: Stack, normalizing: pb_grpc.GenerationServiceStub) -> None:
    before = rewrites("gw-html-ids")
    call = normalizing.Generate(pb.GenerateRequest(request_id="n-1", prompt=TABLE, max_tokens=8))
    first = await anext(aiter(call))
    leased = [req for _consumer, req in stack.queue.pending("cpu").values() if req.request_id == "n-1"]
    assert [r.prompt for r in leased] == [REDACTED]
    ids = list(first.token_ids) + [t async for m in call for t in m.token_ids]
    assert rewrites("gw-html-ids") == before + 1

    # The engine generated from the redacted text (the fake engine's tokens follow from the prompt's
    # bytes): the same tokens as the redacted prompt sent through the plain gateway, not the original's.
    async def plain(text: str) -> list[int]:
        msgs = stack.stub.Generate(pb.GenerateRequest(prompt=text, max_tokens=8))
        return [t async for m in msgs for t in m.token_ids]

    assert ids == await plain(REDACTED)
    assert ids != await plain(TABLE)


async def test_chat_rules_reach_the_worker_and_leave_other_roles(
    stack: Stack, normalizing: pb_grpc.GenerationServiceStub
) -> None:
    turns = [
        pb.ChatMessage(role="system", content="today is 2024-01-02"),
        pb.ChatMessage(role="user", content='on 2024-05-06 see <p id="x-1">'),
    ]
    sent = [m async for m in normalizing.Generate(pb.GenerateRequest(request_id="n-2", messages=turns, max_tokens=4))]
    want = [
        pb.ChatMessage(role="system", content="today is 2024-01-02"),
        pb.ChatMessage(role="user", content='on DATE see <p id="REDACTED">'),
    ]
    plain = [m async for m in stack.stub.Generate(pb.GenerateRequest(messages=want, max_tokens=4))]
    assert [t for m in sent for t in m.token_ids] == [t for m in plain for t in m.token_ids]
    assert sent[-1].usage.prompt_tokens == plain[-1].usage.prompt_tokens


async def test_tokenize_counts_the_rewritten_prompt(stack: Stack, normalizing: pb_grpc.GenerationServiceStub) -> None:
    got = await normalizing.Tokenize(pb.TokenizeRequest(prompt=TABLE))
    assert list(got.token_ids) == list((await stack.stub.Tokenize(pb.TokenizeRequest(prompt=REDACTED))).token_ids)
    assert list(got.token_ids) != list((await stack.stub.Tokenize(pb.TokenizeRequest(prompt=TABLE))).token_ids)


@pytest.mark.parametrize("stack", [Config(gateway=SETTINGS, batches=True, workers=())], indirect=True)
async def test_batch_items_are_stored_rewritten(stack: Stack) -> None:
    items = [
        bpb.BatchItem(custom_id="a", request=pb.GenerateRequest(prompt=TABLE)),
        bpb.BatchItem(custom_id="b", request=pb.GenerateRequest(prompt="no ids")),
    ]
    await stack.batch.BatchGenerate(bpb.BatchGenerateRequest(batch_id="items", items=items))
    docs = [bpb.Document(custom_id="d", text='<td id="9f-2">on 2024-05-06</td>')]
    summarise = bpb.Summarise(template="Summarise: {document}", documents=docs)
    await stack.batch.BatchGenerate(bpb.BatchGenerateRequest(batch_id="docs", summarise=summarise))
    assert stack.batches is not None
    leased = {r.request.custom_id: r.request for r in await stack.batches.lease_items("cpu", "t", 10, None)}
    assert leased["a"].prompt == REDACTED and leased["b"].prompt == "no ids"
    assert leased["d"].messages == (ChatMessage("user", 'Summarise: <td id="REDACTED">on DATE</td>'),)


async def test_a_bad_rule_stops_the_gateway_from_starting() -> None:
    bad = json.dumps([{"name": "broken", "pattern": "id=[a-z", "replacement": ""}])
    with pytest.raises(ValueError, match="rule 'broken': pattern does not compile"):
        await start_gateway(MemoryQueue(), GatewaySettings(port=0, models="tiny=cpu", normalize_rules=bad), port=0)
