"""Secured nodes of real processes: redis-server, a gateway speaking TLS with a tenants file, and a
fake-engine worker. The tenants' API keys are made with the real ``llamamesh auth create-key``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llamamesh.client import Client, serving
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess
from tests.security.conftest import PKI


def create_key(path: Path, tenant: str, *flags: str) -> str:
    """A new key for ``tenant`` through the CLI, as an operator makes one."""
    got = subprocess.run(
        [sys.executable, "-m", "llamamesh.cli", "auth", "create-key", tenant, "--file", str(path), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return got.stdout.strip()


def key_id(key: str) -> str:
    return key.split("_")[1]


class SecuredNode(ProcessNode):
    def __init__(self, workdir: Path, redis: RedisProcess, pki: PKI, env: dict[str, str]) -> None:
        super().__init__(
            workdir,
            redis,
            engine="fake",
            extra_env={
                "LLAMAMESH_GATEWAY_TLS_CERT": str(pki.server.cert),
                "LLAMAMESH_GATEWAY_TLS_KEY": str(pki.server.key),
                "LLAMAMESH_WORKER_MAX_INFLIGHT": "16",
                **env,
            },
        )
        self.ca = str(pki.ca.cert)

    def _serving(self, service: str = "") -> bool:
        return serving(self.address, service, tls_ca=self.ca)

    def client(self, key: str = "", **options: Any) -> Client:
        return Client(self.address, api_key=key, tls_ca=self.ca, **options)


@dataclass
class Tenants:
    file: Path
    keys: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, *flags: str, **tenant: Any) -> str:
        key = create_key(self.file, name, *flags)
        if tenant:
            doc = json.loads(self.file.read_text())
            doc["tenants"][name].update(tenant)
            self.file.write_text(json.dumps(doc))
        self.keys[name] = key
        return key

    def revoke(self, key: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "llamamesh.cli", "auth", "revoke-key", key_id(key), "--file", str(self.file)],
            check=True,
            capture_output=True,
            timeout=60,
        )


def start_node(
    tmp: pytest.TempPathFactory,
    redis: RedisProcess,
    pki: PKI,
    name: str,
    tenants: dict[str, dict[str, Any]],
    env: dict[str, str] | None = None,
) -> Iterator[tuple[SecuredNode, Tenants]]:
    """A node whose tenants file holds ``tenants`` (name -> its entry; ``"admin": True`` makes its
    key an admin key), each with one key."""
    workdir = tmp.mktemp(name)
    t = Tenants(workdir / "tenants.json")
    for tenant, entry in tenants.items():
        entry = dict(entry)
        flags = ("--admin",) if entry.pop("admin", False) else ()
        t.add(tenant, *flags, **entry)
    node = SecuredNode(workdir, redis, pki, {"LLAMAMESH_AUTH_FILE": str(t.file), **(env or {})})
    try:
        node.start()
        yield node, t
    finally:
        node.stop()
