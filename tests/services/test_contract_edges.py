"""The edges of the public contract, each as documented in the protos and the README: an Attach past
the end, a Cancel ahead of its Generate, bounded metadata, a full Redis, and the ErrorInfo every
error status of the gateway's own carries."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status
from prometheus_client import REGISTRY

from llamamesh.client import error_reason, field_violations
from llamamesh.queue import memory
from llamamesh.v1 import generation_pb2 as pb
from tests.services.conftest import Stack

pytestmark = pytest.mark.timeout(30)


async def read(stream: object) -> list[pb.GenerateResponse]:
    return [m async for m in stream]  # type: ignore[attr-defined]


async def test_attach_past_the_end_is_out_of_range_naming_the_offset(stack: Stack) -> None:
    msgs = await read(stack.stub.Generate(pb.GenerateRequest(request_id="done", prompt="x", max_tokens=20)))
    assert sum(len(m.token_ids) for m in msgs) == 20
    at_end = await read(stack.stub.Attach(pb.AttachRequest(request_id="done", offset=20)))
    assert [(m.token_ids, m.finish_reason) for m in at_end] == [([], pb.FINISH_REASON_LENGTH)]  # just the end
    with pytest.raises(grpc.aio.AioRpcError) as past:
        await read(stack.stub.Attach(pb.AttachRequest(request_id="done", offset=21)))
    assert past.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "offset 21" in (past.value.details() or "") and "after 20 tokens" in (past.value.details() or "")
    assert error_reason(past.value) == "OUT_OF_RANGE"


async def test_a_cancel_ahead_of_its_generate_holds_briefly_then_the_id_is_free(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    await stack.stub.Cancel(pb.CancelRequest(request_id="early"))
    first = await read(stack.stub.Generate(pb.GenerateRequest(request_id="early", prompt="x", max_tokens=5)))
    assert first[-1].finish_reason == pb.FINISH_REASON_CANCELLED  # the Cancel overtook its Generate
    monkeypatch.setattr(memory, "CANCEL_AHEAD_TTL_S", 0.0)  # (10 s in production)
    await stack.stub.Cancel(pb.CancelRequest(request_id="later"))
    msgs = await read(stack.stub.Generate(pb.GenerateRequest(request_id="later", prompt="x", max_tokens=5)))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and sum(len(m.token_ids) for m in msgs) == 5


LABELS = [
    ({"k": "v" * 1_000_000}, "metadata[k]"),
    ({f"k{i}": "v" for i in range(65)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
]


@pytest.mark.parametrize(("labels", "field"), LABELS)
async def test_metadata_is_bounded(stack: Stack, labels: dict[str, str], field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await read(stack.stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2, metadata=labels)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(bad.value) == [field]
    assert error_reason(bad.value) == "INVALID_ARGUMENT"


async def test_a_full_redis_is_resource_exhausted_with_retry_info_and_shows_in_health(stack: Stack) -> None:
    health = health_pb2_grpc.HealthStub(stack.channel)
    stack.queue.full = True
    await stack.gateway.health.check_now()
    with pytest.raises(grpc.aio.AioRpcError) as full:
        await read(stack.stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2)))
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Redis is full" in (full.value.details() or "")
    st = rpc_status.from_call(full.value)
    retry = error_details_pb2.RetryInfo()
    assert st is not None and st.details[0].Unpack(retry) and retry.retry_delay.seconds > 0
    assert error_reason(full.value) == "QUEUE_OUT_OF_MEMORY"
    assert REGISTRY.get_sample_value("llamamesh_queue_full") == 1
    refusals = REGISTRY.get_sample_value("llamamesh_admission_rejected_total", {"reason": "queue_out_of_memory"})
    assert (refusals or 0) >= 1
    check = health_pb2.HealthCheckRequest
    assert (await health.Check(check(service="llamamesh.queue"))).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert (await health.Check(check(service=""))).status == health_pb2.HealthCheckResponse.SERVING  # still ready
    stack.queue.full = False
    await stack.gateway.health.check_now()
    assert (await health.Check(check(service="llamamesh.queue"))).status == health_pb2.HealthCheckResponse.SERVING
    assert REGISTRY.get_sample_value("llamamesh_queue_full") == 0
    msgs = await asyncio.wait_for(read(stack.stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2))), 10)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


IDS = [
    ("a.b_c:d-e", True),
    ("..", True),
    ("x" * 128, True),
    ("a/b", False),
    ("a~b", False),
    ("a b", False),
    ("\N{OCTOPUS}", False),
    ("x" * 129, False),
]


@pytest.mark.parametrize(("request_id", "ok"), IDS)
async def test_request_ids_are_the_documented_characters(stack: Stack, request_id: str, ok: bool) -> None:
    call = stack.stub.Generate(pb.GenerateRequest(request_id=request_id, prompt="x", max_tokens=1))
    if ok:
        assert (await read(call))[-1].request_id == request_id
        return
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await read(call)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(bad.value) == ["request_id"]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_answers_under_both_names(stack: Stack, version: str) -> None:
    """grpc.reflection.v1 (what newer tools ask) and v1alpha (grpcurl's) list and describe the API."""
    call = stack.channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="llamamesh.v1.GenerationService"),
    ]
    listed, described = [r async for r in call(iter(asks), timeout=10)]
    names = {s.name for s in listed.list_services_response.service}
    assert {"llamamesh.v1.GenerationService", "grpc.health.v1.Health"} <= names
    raw = described.file_descriptor_response.file_descriptor_proto
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in raw]
    assert any(s.name == "GenerationService" for f in files for s in f.service)
    # every service listed is described too (grpcurl's describe), the reflection services included
    asks = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in sorted(names)]
    for name, answer in zip(sorted(names), [r async for r in call(iter(asks), timeout=10)], strict=True):
        raw = answer.file_descriptor_response.file_descriptor_proto
        described_services = {
            f"{f.package}.{s.name}" for f in map(descriptor_pb2.FileDescriptorProto.FromString, raw) for s in f.service
        }
        assert name in described_services, (name, answer.error_response)


async def test_attach_past_the_end_of_one_sample_sends_nothing_of_the_others(stack: Stack) -> None:
    """An ended request of two samples, sample 0's offset past its end: OUT_OF_RANGE before any message,
    not sample 1's tokens first (the caller may have applied them)."""
    req = pb.GenerateRequest(request_id="ended-two", prompt="x", max_tokens=6, n=2, seed=3)
    assert sum(len(m.token_ids) for m in await read(stack.stub.Generate(req))) == 12
    got: list[pb.GenerateResponse] = []

    async def attach() -> None:
        async for m in stack.stub.Attach(pb.AttachRequest(request_id="ended-two", sample_offsets=[7, 0])):
            got.append(m)

    with pytest.raises(grpc.aio.AioRpcError) as past:
        await attach()
    assert past.value.code() == grpc.StatusCode.OUT_OF_RANGE and got == [], (got, past.value)
    assert "sample_offsets[0] 7" in (past.value.details() or ""), past.value.details()
