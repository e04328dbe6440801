"""The gRPC layer alone over the relay's fake (services/fake_relay.py): each handler converts,
calls the relay and maps errors once; every RPC ends with one ``rpc_finished`` line."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from structlog.testing import capture_logs

from llamamesh import errors
from llamamesh.settings import GatewaySettings
from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services.fake_relay import ScriptedRelay
from services.generation import GenerationServicer
from tests.waiting import until

pytestmark = pytest.mark.timeout(20)


def script(req: GenerationRequest) -> list[JobEvent] | BaseException:
    if req.prompt == "busy":
        return errors.NoWorkers("pool 'cpu' has had no live worker for 10 s")
    if req.kind.value == "tokenize":
        return [JobEvent(token_ids=(1, 2, 3), tokenized=True)]
    n = req.sampling.max_tokens or 0
    toks = [JobEvent(text=f"t{i}", token_ids=(i,), index=i) for i in range(n)]
    return [*toks, JobEvent(index=n, finished=Finished(FinishReason.LENGTH, Usage(2, n)))]


@pytest.fixture
async def served() -> AsyncIterator[tuple[generation_pb2_grpc.GenerationServiceStub, ScriptedRelay]]:
    relay = ScriptedRelay(script)
    settings = GatewaySettings(port=0, models="tiny=cpu")
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(relay, settings, settings.model_table()), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield generation_pb2_grpc.GenerationServiceStub(ch), relay
    await server.stop(None)


def finished_lines(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "rpc_finished"]


async def test_every_rpc_ends_with_one_rpc_finished_line(served) -> None:
    stub, relay = served
    with capture_logs() as logs:
        got = [m async for m in stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=3, request_id="r1"))]
        tok = await stub.Tokenize(pb.TokenizeRequest(prompt="hi"))
        await stub.ListModels(pb.ListModelsRequest())
        await stub.Cancel(pb.CancelRequest(request_id="r1"))
        attached = [m async for m in stub.Attach(pb.AttachRequest(request_id="r1", offset=2))]
    assert [m.index for m in got] == [0, 1, 2, 3] and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert attached[0].token_ids == [2] and attached[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert relay.cancelled == ["r1"] and list(tok.token_ids) == [1, 2, 3]
    lines = finished_lines(logs)
    assert [(e["method"], e["status"]) for e in lines] == [
        ("Generate", "ok"),
        ("Tokenize", "ok"),
        ("ListModels", "ok"),
        ("Cancel", "ok"),
        ("Attach", "ok"),
    ]
    assert lines[0]["completion_tokens"] == 3 and lines[0]["pool"] == "cpu"


async def test_a_relay_error_becomes_its_status_once(served) -> None:
    stub, _relay = served
    with capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [m async for m in stub.Generate(pb.GenerateRequest(prompt="busy", max_tokens=3))]
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Cancel(pb.CancelRequest(request_id="no spaces allowed"))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            _ = [m async for m in stub.Attach(pb.AttachRequest(request_id="nobody"))]
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE and "no live worker" in (err.value.details() or "")
    assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "request_id" in (bad.value.details() or "")
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    assert [e["status"] for e in finished_lines(logs)] == ["UNAVAILABLE", "INVALID_ARGUMENT", "NOT_FOUND"]


async def test_a_caller_that_goes_away_leaves_the_stream_to_the_relay(served) -> None:
    stub, relay = served
    relay.stall_after = 1  # still streaming when the caller leaves, whatever gRPC had buffered
    with capture_logs() as logs:
        call = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=50, request_id="gone"))
        assert (await call.read()).index == 0
        call.cancel()
        noticed = lambda: "gone" in relay.abandoned and finished_lines(logs)  # noqa: E731
        await until(noticed, 10, "the server side to notice the cancel")
    assert "gone" in relay.abandoned
    assert finished_lines(logs)[0]["status"] == "CANCELLED"
