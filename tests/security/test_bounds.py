"""Bounded requests on an in-process gateway: the concurrent-RPC cap, prompt length in characters,
unparseable bytes, and reflection turned off."""

from __future__ import annotations

import gc
import types
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llamamesh.client import Client, field_violations
from llamamesh.queue.memory import MemoryBatches
from llamamesh.settings import AuthSettings, BatchSettings, GatewaySettings
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services import auth
from services.server import Gateway
from tests.security.secured import create_key
from tests.stacks import gateway_in_process
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def gateway(request: pytest.FixtureRequest) -> AsyncIterator[Gateway]:
    async with gateway_in_process(getattr(request, "param", GatewaySettings())) as gw:
        yield gw


@pytest.mark.parametrize("gateway", [GatewaySettings(max_concurrent_rpcs=1, no_worker_wait_s=20)], indirect=True)
async def test_the_concurrent_rpc_cap(gateway: Gateway) -> None:
    async with Client(f"127.0.0.1:{gateway.port}") as c:
        held = c.stub.Generate(pb.GenerateRequest(prompt="p"))  # no worker: it waits, holding its slot
        await held.initial_metadata()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await c.list_models()
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "LLAMAMESH_GATEWAY_MAX_CONCURRENT_RPCS" in (exc.value.details() or "")
        assert await c.health() == health_pb2.HealthCheckResponse.SERVING  # health is never capped
        held.cancel()

        async def listed() -> bool:
            try:
                assert await c.list_models()
            except grpc.aio.AioRpcError:
                return False
            return True

        await until(listed, 10, "the held call's slot given back as it ends", poll_s=0.02)


@pytest.mark.parametrize("gateway", [GatewaySettings(max_prompt_chars=10)], indirect=True)
async def test_prompts_are_bounded_in_characters_before_tokenising(gateway: Gateway) -> None:
    async with Client(f"127.0.0.1:{gateway.port}") as c:
        for kwargs, field in (({"prompt": "x" * 11}, "prompt"), ({"messages": [("user", "x" * 6)] * 2}, "messages")):
            for call in (c.complete, c.tokenize):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call(**kwargs)  # type: ignore[operator]
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(exc.value) == [field]
                assert "LLAMAMESH_GATEWAY_MAX_PROMPT_CHARS" in (exc.value.details() or "")


async def test_bytes_that_do_not_parse_are_invalid_argument(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as ch:
        for method in ("/llamamesh.v1.GenerationService/ListModels", "/llamamesh.v1.GenerationService/Cancel"):
            call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call(b"\xff\xff\xff\xff")
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method


@pytest.mark.parametrize("gateway", [GatewaySettings(reflection=False)], indirect=True)
async def test_reflection_can_be_turned_off(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                pass
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


def frames_holding(request: bytes) -> list[str]:
    """The live frames of the gateway's code with ``request`` (its bytes, or parsed) in a variable."""

    def holds(value: object) -> bool:  # (type(), not isinstance: some objects warn when asked their __class__)
        if type(value) in (bytes, bytearray):
            return len(value) >= len(request)  # type: ignore[arg-type]
        if type(value) is auth._Unparsed:
            return len(value.data) >= len(request)  # type: ignore[attr-defined]
        return type(value) is bpb.BatchGenerateRequest

    frames = [o for o in gc.get_objects() if type(o) is types.FrameType and "/services/" in o.f_code.co_filename]
    return [f"{f.f_code.co_name} {name}" for f in frames for name, v in f.f_locals.items() if holds(v)]


async def test_a_refused_requests_bytes_are_let_go_when_its_call_ends(tmp_path: Path) -> None:
    """Refused without a key, with a wrong one, or as invalid: no frame of the gateway holds the
    request once its call ended (grpc keeps the call's error, whose frames held it, in cycles that
    only the garbage collector's full pass, off here, would free: the gateway grew by each large
    request)."""
    auth = tmp_path / "tenants.json"
    key = create_key(auth, "alpha")
    items = [bpb.BatchItem(custom_id=f"c{i}", request=pb.GenerateRequest(prompt="y" * 1000)) for i in range(2000)]
    big = bpb.BatchGenerateRequest(items=items).SerializeToString()  # 2 MB, over max_items
    options = {"auth": AuthSettings(file=str(auth)), "batches": MemoryBatches(), "batch": BatchSettings(max_items=10)}
    async with (
        gateway_in_process(GatewaySettings(), **options) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel,
    ):
        call = channel.unary_unary("/llamamesh.v1.BatchService/BatchGenerate")
        gc.collect()
        gc.disable()
        try:
            for metadata, code in [
                ((), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", f"Bearer {key}"),), grpc.StatusCode.INVALID_ARGUMENT),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call(big, metadata=metadata, timeout=20)
                assert exc.value.code() == code
                await until(lambda: frames_holding(big) == [], 5, f"the request of the call refused {code} let go")
        finally:
            gc.enable()
