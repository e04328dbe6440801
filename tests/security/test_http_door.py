"""The HTTP door behind the same gatekeeper as gRPC: with a tenants file, no key, a malformed
header and an unknown key are 401 in OpenAI's shape, a tenant's key is let in (the decision logged
once, never the key); with the gateway's TLS settings, the door speaks TLS only, and with a client
CA it requires a client certificate, which maps to its tenant as on gRPC."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import pytest
import structlog

from llamamesh.settings import AuthSettings, GatewaySettings
from services import gateway
from services.http import door
from tests.redisproc import free_port
from tests.security.conftest import PKI
from tests.security.secured import create_key
from tests.stacks import gateway_in_process

pytestmark = pytest.mark.timeout(60)


async def test_keys_are_checked_as_on_grpc(tmp_path: Path) -> None:
    auth = tmp_path / "tenants.json"
    key = create_key(auth, "alpha")
    port = free_port()
    settings = GatewaySettings(port=0, http_port=port)
    url = f"http://127.0.0.1:{port}/v1"
    async with gateway_in_process(settings, auth=AuthSettings(file=str(auth))):
        with structlog.testing.capture_logs() as logs:
            for api_key in ("", "llm_wrong_key", key):
                async with openai.AsyncOpenAI(base_url=url, api_key=api_key or "x", max_retries=0) as c:
                    if api_key == key:
                        assert [m.id async for m in c.models.list()] == ["smollm2-135m-instruct"]
                        continue
                    with pytest.raises(openai.AuthenticationError) as exc:
                        await c.models.list()
                    assert exc.value.status_code == 401 and exc.value.type == "authentication_error"
            async with aiohttp.ClientSession() as s:
                headers = {"authorization": "Basic abc"}
                async with s.post(f"{url}/chat/completions", json={}, headers=headers) as r:
                    assert r.status == 401 and "Bearer" in (await r.json())["error"]["message"]
        decisions = [e for e in logs if e["event"] == "auth_decided"]
        assert [d["outcome"] for d in decisions] == ["unauthenticated", "unauthenticated", "allowed", "unauthenticated"]
        assert decisions[2]["tenant"] == "alpha"
        assert key not in json.dumps([dict(e) for e in logs], default=str)
        # as on gRPC, a refused caller's call is counted as refused only (llamamesh_admission_rejected_total),
        # not as a call served (rpc_finished, counted in llamamesh_requests_total)
        assert [e["status"] for e in logs if e["event"] == "rpc_finished"] == ["ok"]


async def test_a_malformed_head_or_a_key_of_other_bytes_leaves_no_key_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auth = tmp_path / "tenants.json"
    key = create_key(auth, "alpha")
    port = free_port()
    async with gateway_in_process(GatewaySettings(port=0, http_port=port), auth=AuthSettings(file=str(auth))):
        heads = [  # each refused by aiohttp's parser, whose error quotes the bytes it stopped at
            f"Authorization: Bearer {key}{'x' * 9000}".encode(),  # longer than a header may be
            f"Authorization: Bearer {key}\x01".encode(),  # a control character
            f"Authorization : Bearer {key}".encode(),  # a space before the colon
        ]
        with caplog.at_level(logging.DEBUG):
            for head in heads:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n")
                status = await asyncio.wait_for(reader.readline(), 10)
                assert status.split()[1] == b"400", status
                writer.close()
            other_bytes = {"authorization": "Bearer \udcff"}  # not UTF-8 where a key goes: 401, not 500
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"http://127.0.0.1:{port}/v1/models", headers=other_bytes) as r,
            ):
                assert r.status == 401, await r.text()
    refused = [r for r in caplog.records if r.name == "llamamesh.http.protocol"]
    assert len(refused) == len(heads) and all(r.exc_info is None for r in refused)
    secret = key.split("_", 2)[2]  # lm_<key id>_<secret>: the secret may hold "_" itself
    assert len(secret) > 40 and secret not in caplog.text and secret[:12] not in caplog.text


async def test_connections_that_send_nothing_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(door, "IDLE_S", 0.5)
    monkeypatch.setattr(gateway, "HANDSHAKE_S", 0.5)
    port = free_port()
    async with gateway_in_process(GatewaySettings(port=0, http_port=port)) as g:
        silent = [  # the HTTP door: nothing, half a request head; the gRPC port: no handshake
            (port, b""),
            (port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"),
            (g.port, b""),
        ]
        for target, sent in silent:
            reader, writer = await asyncio.open_connection("127.0.0.1", target)
            writer.write(sent)
            await asyncio.wait_for(reader.read(), 10)  # all it says (gRPC: a GOAWAY), then closed
            assert reader.at_eof(), target
            writer.close()


def test_the_gateway_raises_its_open_files_limit_to_the_hard_one() -> None:
    code = (
        "import resource; from services.server import raise_open_files_limit as r; "
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "  # as a container may start it
        "print(r(), min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got, want = out.stdout.split()
    assert got == want and int(got) > 256


async def test_tls_and_client_certificates_as_on_grpc(pki: PKI, tmp_path: Path) -> None:
    auth = tmp_path / "tenants.json"
    create_key(auth, "alpha")
    doc = json.loads(auth.read_text())
    doc["tenants"]["alpha"]["certificates"] = ["tenant-a"]
    auth.write_text(json.dumps(doc))
    port = free_port()
    settings = GatewaySettings(port=0, http_port=port, tls_cert=str(pki.server.cert), tls_key=str(pki.server.key))
    trusting = ssl.create_default_context(cafile=str(pki.ca.cert))
    async with gateway_in_process(settings), aiohttp.ClientSession() as s:
        async with s.get(f"https://127.0.0.1:{port}/v1/models", ssl=trusting) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientError):  # plaintext to a TLS port
            async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                await r.read()
    mutual = replace(settings, tls_client_ca=str(pki.ca.cert))
    with_cert = ssl.create_default_context(cafile=str(pki.ca.cert))
    with_cert.load_cert_chain(str(pki.client.cert), str(pki.client.key))
    async with gateway_in_process(mutual, auth=AuthSettings(file=str(auth))):
        with structlog.testing.capture_logs() as logs:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"https://127.0.0.1:{port}/v1/models", ssl=with_cert) as r:
                    assert r.status == 200
                with pytest.raises(aiohttp.ClientError):  # no client certificate: refused at the handshake
                    async with s.get(f"https://127.0.0.1:{port}/v1/models", ssl=trusting) as r:
                        await r.read()
        decided = [e for e in logs if e["event"] == "auth_decided"]
        assert decided[0]["tenant"] == "alpha" and decided[0]["via"] == "certificate"


async def fetch_models(port: int, trust: ssl.SSLContext) -> int:
    """GET /v1/models over a new connection (a new handshake)."""
    async with aiohttp.ClientSession() as s, s.get(f"https://127.0.0.1:{port}/v1/models", ssl=trust) as r:
        return r.status


def trusting(ca: Path, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return context


async def test_renewed_files_serve_the_doors_new_connections_without_a_restart(pki: PKI, tmp_path: Path) -> None:
    """As on gRPC (tests/security/test_tls.py): a renewed certificate and key, and a new client CA,
    take effect at the next handshake (a Kubernetes Secret is updated in place)."""
    cert, key, ca = tmp_path / "gw.crt", tmp_path / "gw.key", tmp_path / "clients.crt"
    for src, dst in ((pki.server.cert, cert), (pki.server.key, key), (pki.ca.cert, ca)):
        dst.write_bytes(src.read_bytes())
    port = free_port()
    settings = GatewaySettings(port=0, http_port=port, tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ca))
    old = trusting(pki.ca.cert, (pki.client.cert, pki.client.key))
    new = trusting(pki.other_ca.cert, (pki.other_client.cert, pki.other_client.key))
    async with gateway_in_process(settings):
        assert await fetch_models(port, old) == 200
        with pytest.raises(aiohttp.ClientError):
            await fetch_models(port, new)
        with structlog.testing.capture_logs() as logs:
            cert.write_bytes(pki.other_server.cert.read_bytes())  # half-written: the old pair goes on
            assert await fetch_models(port, old) == 200
            key.write_bytes(pki.other_server.key.read_bytes())
            ca.write_bytes(pki.other_ca.cert.read_bytes())
            assert await fetch_models(port, new) == 200
        events = [e["event"] for e in logs if e["event"].startswith("gateway_tls")]
        assert events[0] == "gateway_tls_reload_failed" and events[-1] == "gateway_tls_reloaded", events
        for stale in (old, trusting(pki.other_ca.cert, (pki.client.cert, pki.client.key))):
            with pytest.raises(aiohttp.ClientError):  # the old certificate, or a client of the old CA
                await fetch_models(port, stale)
