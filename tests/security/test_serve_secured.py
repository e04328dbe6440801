"""`llamamesh serve` with authentication on, with TLS, and with mutual TLS: the node says it is ready
(its watch uses the gateway's health service, which needs no key, and the node's own client
certificate for mTLS), writes no flood of refused calls meanwhile, and serves callers with credentials
while refusing those without."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from llamamesh.client import Client
from tests.e2e.test_serve import serve_node
from tests.security.conftest import PKI
from tests.security.secured import Tenants

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def tls_env(pki: PKI, mutual: bool) -> dict[str, str]:
    env = {
        "LLAMAMESH_GATEWAY_TLS_CERT": str(pki.server.cert),
        "LLAMAMESH_GATEWAY_TLS_KEY": str(pki.server.key),
        "LLAMAMESH_CLIENT_TLS_CA": str(pki.ca.cert),
    }
    if mutual:
        env |= {
            "LLAMAMESH_GATEWAY_TLS_CLIENT_CA": str(pki.ca.cert),
            "LLAMAMESH_CLIENT_TLS_CERT": str(pki.client.cert),
            "LLAMAMESH_CLIENT_TLS_KEY": str(pki.client.key),
        }
    return env


@pytest.mark.parametrize("transport", ["plaintext", "tls", "mtls"])
async def test_a_secured_node_says_ready_and_serves_only_callers_with_a_key(
    tmp_path: Path, pki: PKI, transport: str
) -> None:
    tenants = Tenants(tmp_path / "tenants.json")
    key = tenants.add("alpha")
    env = {"LLAMAMESH_AUTH_FILE": str(tenants.file), "LLAMAMESH_WORKER_ENGINE": "fake"}
    if transport != "plaintext":
        env |= tls_env(pki, mutual=transport == "mtls")
    tls = {} if transport == "plaintext" else {"tls_ca": str(pki.ca.cert)}
    if transport == "mtls":
        tls |= {"tls_cert": str(pki.client.cert), "tls_key": str(pki.client.key)}
    with serve_node(tmp_path, **env) as node:
        out = node.text()
        assert "ready: 1 worker(s) serving on" in out and "llamamesh serving on" in out
        assert out.count('"auth_decided"') == 0, out[-2000:]  # the node's watch needed no key
        async with Client(node.address, api_key=key, **tls) as client:
            assert await client.complete("hi", max_tokens=4)
        async with Client(node.address, **tls) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anonymous.complete("hi", max_tokens=4)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
