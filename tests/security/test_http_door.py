"""The HTTP door behind the same gatekeeper as gRPC: with a tenants file, no key, a malformed
header and an unknown key are 401 in OpenAI's shape, a tenant's key is let in (the decision logged
once, never the key); with the gateway's TLS settings, the door speaks TLS only, and with a client
CA it requires a client certificate, which maps to its tenant as on gRPC."""

from __future__ import annotations

import json
import ssl
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import pytest
import structlog

from llamamesh.settings import AuthSettings, GatewaySettings
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
