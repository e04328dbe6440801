"""The session's test PKI: two CAs, a server certificate for loopback, client certificates."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.redisproc import RedisProcess
from tests.security.certs import CA, Pair, issue, make_ca


@dataclass(frozen=True)
class PKI:
    ca: CA
    other_ca: CA
    server: Pair  # signed by ca, for 127.0.0.1 / localhost
    other_server: Pair  # signed by other_ca, for 127.0.0.1 / localhost
    client: Pair  # signed by ca, CN tenant-a
    other_client: Pair  # signed by other_ca, CN tenant-a


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "ca"), make_ca(d, "other-ca")
    return PKI(
        ca=ca,
        other_ca=other,
        server=issue(ca, d, "server", "gateway", server=True),
        other_server=issue(other, d, "other-server", "gateway-2", server=True),
        client=issue(ca, d, "client", "tenant-a", server=False),
        other_client=issue(other, d, "other-client", "tenant-a", server=False),
    )


@pytest.fixture(scope="session")
def security_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One real server for the secured nodes (each node has its own key prefix)."""
    kind = "redis" if shutil.which("redis-server") else "valkey"
    server = RedisProcess(kind, tmp_path_factory.mktemp("security-redis"))
    server.start()
    yield server
    server.stop()
