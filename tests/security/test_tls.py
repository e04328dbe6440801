"""The gateway's port over TLS and mutual TLS, certificate rotation, the plaintext warning, and the
client's connection options (TLS files, API key on every call, the CLI's flags), over real gRPC on
loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from structlog.testing import capture_logs

from llamamesh.cli.node import Node, StartFailed
from llamamesh.client import Client, Connection, SyncClient, serving
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import ClientSettings, GatewaySettings, Settings, WorkerSettings
from llamamesh.v1 import generation_pb2 as pb
from services import tls
from services.server import start_gateway
from tests.redisproc import free_port
from tests.security.conftest import PKI
from tests.stacks import gateway_in_process, stop_in_process
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = pytest.mark.timeout(60)

AUTH = ("authorization", "Bearer k-123")


# --- a test-only service: what each call carried and which certificate it came with


@dataclass
class Seen:
    method: str
    metadata: tuple[tuple[str, str], ...]
    identities: tuple[str, ...]


@dataclass
class Probe:
    calls: list[Seen] = field(default_factory=list)

    def _saw(self, method: str, context: grpc.aio.ServicerContext) -> None:
        md = tuple((k, v) for k, v in context.invocation_metadata() or () if isinstance(v, str))
        self.calls.append(Seen(method, md, tls.peer_identities(context)))

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._saw("unary", context)
        return request

    async def server_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self._saw("server_stream", context)
        yield request
        yield request

    async def client_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        self._saw("client_stream", context)
        return b"".join([r async for r in requests])

    async def bidi(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self._saw("bidi", context)
        async for r in requests:
            yield r

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "test.Probe",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
                "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
            },
        )


@contextlib.asynccontextmanager
async def probe_server(settings: GatewaySettings) -> AsyncIterator[tuple[str, Probe]]:
    server = grpc.aio.server()
    probe = Probe()
    server.add_generic_rpc_handlers((probe.handler(),))
    port = tls.bind(server, settings, 0)
    await server.start()
    try:
        yield f"127.0.0.1:{port}", probe
    finally:
        await server.stop(None)


async def unary(address: str, conn: Connection) -> bytes:
    async with conn.aio_channel(address) as ch:
        return bytes(await ch.unary_unary("/test.Probe/Unary")(b"ping", timeout=5))


async def refused(address: str, conn: Connection) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(address, conn)
    return err.value.code()


def server_tls(pki: PKI, mutual: bool = False) -> GatewaySettings:
    return GatewaySettings(
        port=0,
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        tls_client_ca=str(pki.ca.cert) if mutual else "",
    )


# --- the gateway over TLS


async def list_models(address: str, **options: str) -> list[str]:
    async with Client(address, **options) as c:  # type: ignore[arg-type]
        reply = await c.stub.ListModels(pb.ListModelsRequest(), timeout=5)
        return [m.id for m in reply.models]


async def test_a_tls_gateway_answers_clients_trusting_its_ca_only(pki: PKI) -> None:
    async with gateway_in_process(server_tls(pki)) as gw:
        address = f"127.0.0.1:{gw.port}"
        assert await list_models(address, tls_ca=str(pki.ca.cert)) == ["smollm2-135m-instruct"]
        # the name checked: localhost is in the certificate, "elsewhere" is not
        assert await list_models(address, tls_ca=str(pki.ca.cert), tls_server_name="localhost")
        for options in ({}, {"tls_ca": str(pki.other_ca.cert)}, {"tls_ca": str(pki.ca.cert), "tls_server_name": "x.y"}):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await list_models(address, **options)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, options
        assert await asyncio.to_thread(serving, address, tls_ca=str(pki.ca.cert))
        assert not await asyncio.to_thread(serving, address)


async def test_mutual_tls_refuses_clients_without_a_certificate_from_its_ca_at_the_handshake(pki: PKI) -> None:
    ca = str(pki.ca.cert)
    async with probe_server(server_tls(pki, mutual=True)) as (address, probe):
        assert await refused(address, Connection(tls_ca=ca)) == grpc.StatusCode.UNAVAILABLE
        other = Connection(tls_ca=ca, tls_cert=str(pki.other_client.cert), tls_key=str(pki.other_client.key))
        assert await refused(address, other) == grpc.StatusCode.UNAVAILABLE
        assert await refused(address, Connection()) == grpc.StatusCode.UNAVAILABLE
        assert probe.calls == []  # no refused client reached a handler
        good = Connection(tls_ca=ca, tls_cert=str(pki.client.cert), tls_key=str(pki.client.key))
        assert await unary(address, good) == b"ping"
        assert [c.identities for c in probe.calls] == [("tenant-a",)]


async def test_peer_identities_are_empty_without_mutual_tls(pki: PKI) -> None:
    async with probe_server(server_tls(pki)) as (address, probe):
        # a client certificate the server did not ask for is not an identity
        conn = Connection(tls_ca=str(pki.ca.cert), tls_cert=str(pki.client.cert), tls_key=str(pki.client.key))
        assert await unary(address, conn) == b"ping"
    async with probe_server(GatewaySettings(port=0)) as (address, plain):
        assert await unary(address, Connection()) == b"ping"
    assert probe.calls[0].identities == () and plain.calls[0].identities == ()


async def test_mutual_tls_gateway_serves_a_client_with_its_certificate(pki: PKI) -> None:
    async with gateway_in_process(server_tls(pki, mutual=True)) as gw:
        settings = ClientSettings(
            api_key="k", tls_ca=str(pki.ca.cert), tls_cert=str(pki.client.cert), tls_key=str(pki.client.key)
        )
        async with Client.from_settings(f"localhost:{gw.port}", settings) as c:
            assert [m.id for m in await c.list_models()] == ["smollm2-135m-instruct"]


async def test_rotated_files_serve_new_connections_without_a_restart(pki: PKI, tmp_path: Path) -> None:
    cert, key = tmp_path / "gw.crt", tmp_path / "gw.key"
    shutil.copyfile(pki.server.cert, cert)
    shutil.copyfile(pki.server.key, key)
    old, new = Connection(tls_ca=str(pki.ca.cert)), Connection(tls_ca=str(pki.other_ca.cert))
    async with probe_server(GatewaySettings(port=0, tls_cert=str(cert), tls_key=str(key))) as (address, _probe):
        assert await unary(address, old) == b"ping"
        assert await refused(address, new) == grpc.StatusCode.UNAVAILABLE
        # half-written: the new certificate with the old key does not load; the old pair goes on
        with capture_logs() as logs:
            cert.write_bytes(pki.other_server.cert.read_bytes())
            assert await unary(address, old) == b"ping"
            assert await unary(address, old) == b"ping"
        assert [e["event"] for e in logs if e["event"].startswith("gateway_tls")] == ["gateway_tls_reload_failed"]
        with capture_logs() as logs:
            key.write_bytes(pki.other_server.key.read_bytes())
            assert await unary(address, new) == b"ping"
        assert [e["event"] for e in logs if e["event"].startswith("gateway_tls")] == ["gateway_tls_reloaded"]
        assert await refused(address, old) == grpc.StatusCode.UNAVAILABLE


async def test_a_file_missing_while_it_is_replaced_keeps_the_current_certificate(pki: PKI, tmp_path: Path) -> None:
    cert, key = tmp_path / "gw.crt", tmp_path / "gw.key"
    shutil.copyfile(pki.server.cert, cert)
    shutil.copyfile(pki.server.key, key)
    conn = Connection(tls_ca=str(pki.ca.cert))
    async with probe_server(GatewaySettings(port=0, tls_cert=str(cert), tls_key=str(key))) as (address, _probe):
        with capture_logs() as logs:
            key.unlink()
            assert await unary(address, conn) == b"ping"
            assert await unary(address, conn) == b"ping"
        failed = [e for e in logs if e["event"] == "gateway_tls_reload_failed"]
        assert len(failed) == 1 and "cannot read" in failed[0]["error"], logs
        shutil.copyfile(pki.server.key, key)
        assert await unary(address, conn) == b"ping"


# --- bind: what it refuses, and the plaintext warning


@pytest.mark.parametrize(
    ("cert", "key", "client_ca", "message"),
    [
        ("cert", "", "", "must be set together"),
        ("", "key", "", "must be set together"),
        ("", "", "ca", "TLS_CLIENT_CA needs"),
        ("cert", "missing", "", "cannot read /nonexistent/gw.key"),
        ("cert", "other_key", "", "not a certificate and its key"),
        ("cert", "key", "key", "holds no CA certificate"),
    ],
)
async def test_bind_refuses_tls_settings_that_cannot_work(
    pki: PKI, cert: str, key: str, client_ca: str, message: str
) -> None:
    files = {
        "": "",
        "cert": str(pki.server.cert),
        "key": str(pki.server.key),
        "missing": "/nonexistent/gw.key",
        "other_key": str(pki.other_server.key),
        "ca": str(pki.ca.cert),
    }
    settings = GatewaySettings(port=0, tls_cert=files[cert], tls_key=files[key], tls_client_ca=files[client_ca])
    server = grpc.aio.server()
    with pytest.raises(ValueError, match=message):
        tls.bind(server, settings, 0)
    await server.stop(None)


async def test_plaintext_on_a_non_loopback_address_is_a_warning() -> None:
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False), ("localhost", False)):
        server = grpc.aio.server()
        with capture_logs() as logs:
            port = tls.bind(server, GatewaySettings(host=host), 0)
        await server.stop(None)
        events = [e for e in logs if e["event"] == "gateway_plaintext"]
        if warned:
            assert events == [{"event": "gateway_plaintext", "log_level": "warning", "host": host, "port": port}]
        else:
            assert events == []


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("gateway.internal", False),
        ("", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert tls.is_loopback(host) is loopback


# --- the API key rides on every call


async def test_the_api_key_is_sent_on_every_kind_of_call_async_and_sync() -> None:
    tenant = ("x-llamamesh-tenant", "t1")
    async with probe_server(GatewaySettings(port=0)) as (address, probe):
        async with Connection(api_key="k-123").aio_channel(address) as ch:
            assert await ch.unary_unary("/test.Probe/Unary")(b"a", metadata=(tenant,), timeout=5) == b"a"
            assert [m async for m in ch.unary_stream("/test.Probe/ServerStream")(b"b", timeout=5)] == [b"b", b"b"]
            assert await ch.stream_unary("/test.Probe/ClientStream")(iter([b"c", b"d"]), timeout=5) == b"cd"
            assert [m async for m in ch.stream_stream("/test.Probe/Bidi")(iter([b"e"]), timeout=5)] == [b"e"]

        def sync_calls() -> None:
            with Connection(api_key="k-123").channel(address) as ch:
                assert ch.unary_unary("/test.Probe/Unary")(b"a", metadata=(tenant,), timeout=5) == b"a"
                assert list(ch.unary_stream("/test.Probe/ServerStream")(b"b", timeout=5)) == [b"b", b"b"]
                assert ch.stream_unary("/test.Probe/ClientStream")(iter([b"c", b"d"]), timeout=5) == b"cd"
                assert list(ch.stream_stream("/test.Probe/Bidi")(iter([b"e"]), timeout=5)) == [b"e"]

        await asyncio.to_thread(sync_calls)
        async with Connection().aio_channel(address) as ch:  # no key: no header
            await ch.unary_unary("/test.Probe/Unary")(b"a", timeout=5)
    methods = ["unary", "server_stream", "client_stream", "bidi"]
    assert [c.method for c in probe.calls] == [*methods, *methods, "unary"]
    for c in probe.calls[:-1]:
        assert [v for k, v in c.metadata if k == "authorization"] == [AUTH[1]], c
    assert tenant in probe.calls[0].metadata and tenant in probe.calls[4].metadata
    assert all(k != "authorization" for k, _v in probe.calls[-1].metadata)


def test_a_client_refuses_a_channel_together_with_connection_options() -> None:
    with pytest.raises(ValueError, match="not both"):
        Client("x:1", channel=object(), api_key="k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot read the client's TLS CA"):
        SyncClient("x:1", tls_ca="/nonexistent/ca.crt")
    with pytest.raises(ValueError, match="together"):
        SyncClient("x:1", tls_cert="/nonexistent/c.crt")


async def test_sync_client_streams_a_generation_over_tls_with_its_key(pki: PKI) -> None:
    queue = MemoryQueue()
    settings = GatewaySettings(
        port=0, models="tiny=cpu", default_max_tokens=4, tls_cert=str(pki.server.cert), tls_key=str(pki.server.key)
    )
    gw = await start_gateway(queue, settings, port=0)
    ws = WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=4)
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, queue, engine, block_ms=100)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        client_settings = ClientSettings(api_key="k-123", tls_ca=str(pki.ca.cert))

        def complete() -> str:
            with SyncClient.from_settings(f"127.0.0.1:{gw.port}", client_settings) as c:
                return c.complete("hello", max_tokens=4, timeout=10)

        assert len((await asyncio.to_thread(complete)).split()) == 4
    finally:
        await stop_in_process(stop, task, gw, engine)


# --- the CLI


async def cli(*args: str, **env: str) -> tuple[int, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLAMAMESH_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llamamesh.cli",
        *args,
        env={**base, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return int(proc.returncode or 0), out.decode()


async def test_cli_reaches_a_mutual_tls_gateway_with_flags_or_environment(pki: PKI) -> None:
    async with gateway_in_process(server_tls(pki, mutual=True)) as gw:
        address = f"127.0.0.1:{gw.port}"
        files = ["--tls-ca", str(pki.ca.cert), "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)]
        env = {
            "LLAMAMESH_CLIENT_TLS_CA": str(pki.ca.cert),
            "LLAMAMESH_CLIENT_TLS_CERT": str(pki.client.cert),
            "LLAMAMESH_CLIENT_TLS_KEY": str(pki.client.key),
        }
        by_flags, by_env, no_cert = await asyncio.gather(
            cli("models", "--address", address, "--api-key", "k", *files),
            cli("models", "--address", address, **env),
            cli("models", "--address", address, "--tls-ca", str(pki.ca.cert)),
        )
    assert by_flags == (0, "smollm2-135m-instruct\tpool=cpu\tdefault\n"), by_flags
    assert by_env == by_flags, by_env
    assert no_cert[0] != 0 and "UNAVAILABLE" in no_cert[1], no_cert


async def test_cli_names_a_tls_file_that_is_not_what_its_flag_says(pki: PKI) -> None:
    """A key given as the CA, or a key that is not the certificate's: one line naming the flags, before any
    connection (gRPC would say only that the handshake failed, after its own log lines)."""
    nobody = f"127.0.0.1:{free_port()}"
    cases = [
        (["--tls-ca", str(pki.client.key)], "--tls-ca"),
        (
            ["--tls-ca", str(pki.ca.cert), "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.server.key)],
            "--tls-key",
        ),
    ]
    for files, flag in cases:
        code, out = await cli("models", "--address", nobody, *files)
        assert code == 1 and flag in out and out.count("\n") == 1 and "UNAVAILABLE" not in out, out


# --- the embedded node watches its TLS gateway start with the client settings


@pytest.mark.timeout(120)
async def test_a_node_with_a_mutual_tls_gateway_becomes_ready(pki: PKI, tmp_path: Path) -> None:
    files = {"tls_ca": str(pki.ca.cert), "tls_cert": str(pki.client.cert), "tls_key": str(pki.client.key)}
    gateway_tls = {"tls_cert": str(pki.server.cert), "tls_key": str(pki.server.key), "tls_client_ca": str(pki.ca.cert)}
    settings = Settings().with_overrides(
        redis={"embedded_dir": str(tmp_path / "redis")},
        gateway={"port": free_port(), **gateway_tls},
        worker={"engine": "fake", "consumer": "tls-node"},
    )
    with pytest.raises(StartFailed, match="LLAMAMESH_CLIENT_TLS_CERT"):
        Node(settings).start()
    node = Node(settings.with_overrides(client=files), log_file=tmp_path / "node.log")
    try:
        node.start()
        await node.wait_ready(timeout_s=90)
        async with node.client() as c:
            assert [m.id for m in await c.list_models()] == ["smollm2-135m-instruct"]
    finally:
        node.stop()


@pytest.mark.timeout(120)
async def test_a_node_whose_gateway_certificate_its_client_cannot_verify_stops_saying_which_setting(
    pki: PKI, tmp_path: Path
) -> None:
    """A gateway certificate from a private CA, and no LLAMAMESH_CLIENT_TLS_CA: the node cannot watch
    its gateway start; it stops at once naming the setting, instead of waiting out its start timeout."""
    settings = Settings().with_overrides(
        redis={"embedded_dir": str(tmp_path / "redis")},
        gateway={"port": free_port(), "tls_cert": str(pki.server.cert), "tls_key": str(pki.server.key)},
        worker={"engine": "fake", "consumer": "tls-untrusted"},
    )
    node = Node(settings, log_file=tmp_path / "node.log")
    try:
        node.start()
        t0 = time.monotonic()
        with pytest.raises(StartFailed, match="LLAMAMESH_CLIENT_TLS_CA"):
            await node.wait_ready(timeout_s=90)
        assert time.monotonic() - t0 < 60
    finally:
        node.stop()


async def test_a_plaintext_health_only_port_answers_probes_while_the_main_port_is_mutual_tls(pki: PKI) -> None:
    """LLAMAMESH_GATEWAY_HEALTH_PORT: Kubernetes' gRPC probes (no TLS) read the gateway's health
    there; nothing but grpc.health.v1 is served on it, and it says NOT_SERVING through a drain."""
    health_port = free_port()
    async with gateway_in_process(replace(server_tls(pki, mutual=True), health_port=health_port)) as gw:
        assert gw.health_port == health_port
        assert await asyncio.to_thread(serving, f"127.0.0.1:{health_port}")
        assert await asyncio.to_thread(serving, f"127.0.0.1:{health_port}", "llamamesh.liveness")
        assert not await asyncio.to_thread(serving, f"127.0.0.1:{gw.port}")  # plaintext: refused there
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/llamamesh.v1.GenerationService/ListModels")(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await gw.health.shutdown()  # as at the start of a drain
            check = ch.unary_unary(
                "/grpc.health.v1.Health/Check",
                health_pb2.HealthCheckRequest.SerializeToString,
                health_pb2.HealthCheckResponse.FromString,
            )
            reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not await asyncio.to_thread(serving, f"127.0.0.1:{health_port}")  # closed with the gateway
