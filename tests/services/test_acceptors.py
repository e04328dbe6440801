"""services/accept.py: the gateway's extra outstanding call requests. Calls they accept run the same
path as grpc's own accept loop: handlers, the gatekeeper (authentication, concurrency bound), a
client's cancel, the server's drain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import structlog

from llamamesh.settings import AuthSettings, GatewaySettings
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services import accept
from tests.security.secured import create_key
from tests.services.conftest import Config, Stack, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

BURST = 48


async def collect(stub: generation_pb2_grpc.GenerationServiceStub, n: int, **meta: str) -> list[pb.GenerateResponse]:
    call = stub.Generate(pb.GenerateRequest(prompt=f"burst {n}", max_tokens=4), metadata=tuple(meta.items()))
    return [m async for m in call]


def test_this_grpcio_has_what_the_acceptors_use() -> None:
    """The pinned grpcio (requirements/lock.txt) has the private API: a new grpcio that changed it
    fails here, not silently in production (where the gateway would fall back to one accept)."""
    assert accept.supported() == ""


async def test_a_burst_of_calls_is_accepted_by_the_extra_requests_and_every_call_completes(stack: Stack) -> None:
    acceptors = stack.gateway.acceptors
    assert acceptors is not None and acceptors.n == GatewaySettings().acceptors > 0
    assert acceptors.running >= acceptors.n  # n per registered method, waiting
    answers = await asyncio.gather(*(collect(stack.stub, i) for i in range(BURST)))
    assert all(msgs and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH for msgs in answers)
    assert acceptors.accepted > 0  # some of the burst went through them, not only grpc's loop
    # Each accepted call re-armed its acceptor: as many wait as before.
    assert acceptors.running >= acceptors.n


@pytest.mark.fake_step_s(0.01)
async def test_a_client_cancel_of_a_call_they_accepted_reaches_the_engine(stack: Stack) -> None:
    """Every stream of a burst dropped by its client mid-way is aborted in the engine, whichever
    path accepted it (grpc's cancellation watch runs for both)."""
    before = stack.gateway.acceptors.accepted if stack.gateway.acceptors else 0
    calls = [stack.stub.Generate(pb.GenerateRequest(prompt=f"long {i}", max_tokens=500)) for i in range(8)]
    for call in calls:
        await call.read()  # the first token: the job runs
    for call in calls:
        call.cancel()
    assert stack.gateway.acceptors is not None and stack.gateway.acceptors.accepted > before

    await until(lambda: len(stack.engine.aborted) >= len(calls), 10, "every dropped stream's abort")


async def test_calls_they_accept_pass_the_gatekeeper(tmp_path: Path) -> None:
    """With a tenants file every call of a burst without a key is UNAUTHENTICATED and every call
    with one is served: the acceptors hand calls to the same interceptors."""
    tenants = tmp_path / "tenants.json"
    key = create_key(tenants, "alpha")
    async with running(Config(gateway=GatewaySettings(port=0), auth=AuthSettings(file=str(tenants)), workers=())) as s:
        calls = [s.stub.ListModels(pb.ListModelsRequest()) for _ in range(BURST)]
        refused = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in refused), refused
        assert {r.code() for r in refused} == {grpc.StatusCode.UNAUTHENTICATED}  # type: ignore[union-attr]
        meta = (("authorization", f"Bearer {key}"),)
        served = await asyncio.gather(*(s.stub.ListModels(pb.ListModelsRequest(), metadata=meta) for _ in range(BURST)))
        assert all(r.models for r in served)
        acceptors = s.gateway.acceptors
        assert acceptors is not None and acceptors.accepted > 0
    assert acceptors.running == 0


async def test_none_with_zero_and_a_grpcio_without_the_api_falls_back_to_grpcs_own_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running(Config(gateway=GatewaySettings(port=0, acceptors=0), workers=())) as s:
        assert s.gateway.acceptors is not None and s.gateway.acceptors.running == 0
    monkeypatch.setattr(accept, "supported", lambda: "cygrpc._handle_rpc(...)")
    with structlog.testing.capture_logs() as logs:
        async with running(Config(gateway=GatewaySettings(port=0), workers=())) as s:
            acceptors = s.gateway.acceptors
            assert acceptors is not None and acceptors.n == 0 and acceptors.running == 0
            missing = [e["missing"] for e in logs if e["event"] == "grpc_acceptors_unavailable"]
            assert missing == ["cygrpc._handle_rpc(...)"]
            answers = await asyncio.gather(*(s.stub.ListModels(pb.ListModelsRequest()) for _ in range(8)))
            assert all(a.models for a in answers)


async def test_a_negative_count_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="LLAMAMESH_GATEWAY_ACCEPTORS"):
        accept.Acceptors(grpc.aio.server(), [], -1)


async def rest_of(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    msgs = []
    while (m := await call.read()) is not grpc.aio.EOF:
        msgs.append(m)
    return msgs


@pytest.mark.fake_step_s(0.01)
async def test_the_drain_serves_open_streams_they_accepted_and_ends_them(stack: Stack) -> None:
    """gateway.stop(grace): streams accepted by the acceptors finish within the grace; the
    acceptors end (the server's shutdown fails their requests)."""
    acceptors = stack.gateway.acceptors
    assert acceptors is not None
    before = acceptors.accepted
    # 200 tokens of 10 ms: running at the stop (a loaded machine may still send one in a message or two)
    calls = [stack.stub.Generate(pb.GenerateRequest(prompt=f"drain {i}", max_tokens=200)) for i in range(8)]
    firsts = [await call.read() for call in calls]
    assert acceptors.accepted > before
    stopping = asyncio.create_task(stack.gateway.stop(10))
    rest = await asyncio.gather(*(rest_of(call) for call in calls))
    await asyncio.wait_for(stopping, 15)
    streams = [[first, *msgs] for first, msgs in zip(firsts, rest, strict=True)]
    assert all(msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH for msgs in streams)
    assert [sum(len(m.token_ids) for m in msgs) for msgs in streams] == [200] * 8
    assert acceptors.running == 0
