"""The gRPC port's connections: clients that ping a quiet connection keep it, a client that vanished has its calls
cancelled by the gateway's own pings (through a TCP relay that can go silent, as a dead host or a NAT that forgot the
flow does), and a call's headers pass or not by their size alone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llamamesh.settings import GatewaySettings
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from services.gateway import transport_options
from tests.services.conftest import GATEWAY, Config, Stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

PINGING = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class Relay:
    """A TCP relay to ``port`` that can go silent: after ``freeze`` it reads and forwards nothing more, in either
    direction, and keeps both connections open."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.frozen = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not self.frozen.is_set():
            data = await reader.read(65536)
            if not data or self.frozen.is_set():
                break
            writer.write(data)
            await writer.drain()
        await asyncio.Event().wait()  # silent, open

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [writer, up_writer]
        self.tasks += [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            for t in self.tasks:
                t.cancel()
            for w in self.writers:
                w.close()
            server.close()


def test_default_options_accept_the_pings_of_go_and_java_clients_and_ping_back() -> None:
    options = dict(transport_options(GatewaySettings(), share_port=False))
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 5000  # Go and Java: 10 s at the most
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.keepalive_time_ms"] == 30_000 and options["grpc.keepalive_timeout_ms"] == 20_000
    assert "grpc.max_connection_age_ms" not in options
    aged = dict(transport_options(GatewaySettings(max_connection_age_s=300, keepalive_s=0), share_port=True))
    assert aged["grpc.max_connection_age_ms"] == 300_000 and aged["grpc.max_connection_age_grace_ms"] == 600_000
    assert aged["grpc.keepalive_time_ms"] == 2**31 - 1 and aged["grpc.so_reuseport"] == 1


@pytest.mark.parametrize("stack", [Config(gateway=replace(GATEWAY, min_client_ping_s=0.5))], indirect=True)
async def test_a_quiet_stream_stays_open_under_a_clients_keepalive_pings(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway.port}", options=PINGING) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        # Five pings on a stream that receives nothing: gRPC's default policy closed it at the third.
        following = asyncio.ensure_future(watch.read())
        done, _ = await asyncio.wait({following}, timeout=5.5)
        assert not done and not watch.done()
        models = await pb_grpc.GenerationServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=5)
        assert models.models
        watch.cancel()


@pytest.mark.parametrize("stack", [Config(gateway=replace(GATEWAY, min_client_ping_s=2))], indirect=True)
async def test_a_client_pinging_faster_than_allowed_is_sent_away(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway.port}", options=PINGING) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        await watch.read()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await asyncio.wait_for(watch.read(), 15)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "ping" in (ei.value.details() or "").lower()


@pytest.mark.fake_step_s(0.1)
@pytest.mark.parametrize(
    "stack", [Config(gateway=replace(GATEWAY, keepalive_s=0.5, keepalive_timeout_s=1.0))], indirect=True
)
async def test_a_client_that_vanishes_mid_stream_has_its_generation_cancelled(stack: Stack) -> None:
    relay = Relay(stack.gateway.port)
    async with relay.serving() as port, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.GenerationServiceStub(channel).Generate(
            pb.GenerateRequest(request_id="gone-1", prompt="long one", max_tokens=500)
        )
        first = await call.read()
        assert isinstance(first, pb.GenerateResponse)
        relay.frozen.set()
        # 500 steps of 0.1 s would run 50 s; the gateway's unanswered ping ends the call within a few.
        await until(lambda: "gone-1" in stack.engine.aborted, 15, "the engine's abort of the vanished client's job")
        await until(lambda: stack.worker.inflight == 0, 5, "the worker's slot back")
        call.cancel()


async def test_headers_up_to_16_kib_always_pass_and_larger_never(stack: Stack) -> None:
    # gRPC's default refuses headers between 8 and 16 KiB at random: a long bearer token failed some calls
    for _ in range(20):
        ok = await stack.stub.ListModels(pb.ListModelsRequest(), metadata=(("x-token", "t" * 12_000),), timeout=5)
        assert ok.models
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stack.stub.ListModels(pb.ListModelsRequest(), metadata=(("x-token", "t" * 20_000),), timeout=5)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
