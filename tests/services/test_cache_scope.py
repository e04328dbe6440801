"""The engine's prefix cache scoped to the tenant (LLAMAMESH_GATEWAY_CACHE_SCOPE): the gateway sets
each request's cache salt from its tenant (the fake engine caches by input and salt, as vLLM does,
and reports cached prompt tokens), so one tenant's prompt never reads as cached to another; global
scope shares; without authentication the default shares, as it always did. Affinity keys each
tenant's prefixes apart too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llamamesh.types import GenerationRequest, tenant_salt
from llamamesh.v1 import generation_pb2 as pb
from services.admission import cache_scoped
from tests.services.conftest import GATEWAY, Config, Stack, running

pytestmark = pytest.mark.timeout(60)

PROMPT = pb.GenerateRequest(
    messages=[pb.ChatMessage(role="user", content="A long shared system prompt.")], max_tokens=2
)


async def cached_as(stack: Stack, tenant: str) -> int:
    """The cached prompt tokens of PROMPT sent by ``tenant``."""
    got = [m async for m in stack.stub.Generate(PROMPT, metadata=(("x-llamamesh-tenant", tenant),))]
    return got[-1].usage.cached_tokens


async def test_a_tenants_prompt_never_reads_as_cached_to_another() -> None:
    async with running(Config(gateway=replace(GATEWAY, cache_scope="tenant"))) as stack:
        assert await cached_as(stack, "alpha") == 0
        assert await cached_as(stack, "beta") == 0  # alpha's prompt, beta's first: not cached for beta
        assert await cached_as(stack, "alpha") > 0  # alpha's repeat is
        salts = stack.engine.salts
        assert salts[0] == salts[2] == tenant_salt("alpha") != salts[1] == tenant_salt("beta")
        assert all(s and "alpha" not in s and "beta" not in s for s in salts)


@pytest.mark.parametrize("scope", ["global", "auto"])
async def test_a_shared_cache_serves_every_tenant(scope: str) -> None:
    """global shares on purpose; auto shares without a tenants file (the embedded default)."""
    async with running(Config(gateway=replace(GATEWAY, cache_scope=scope))) as stack:
        assert await cached_as(stack, "alpha") == 0
        assert await cached_as(stack, "beta") > 0
        assert set(stack.engine.salts) == {""}


def test_affinity_keys_each_tenants_prefixes_apart() -> None:
    req = GenerationRequest(request_id="r", model="m", prompt="x", prefix_key="conv-1")
    a, b = cache_scoped(req, "alpha"), cache_scoped(req, "beta")
    assert a.prefix_key != b.prefix_key and a.prefix_key == cache_scoped(req, "alpha").prefix_key
    assert a.cache_salt == tenant_salt("alpha") and a.prefix_key.endswith("conv-1")
    assert cache_scoped(replace(req, prefix_key=""), "alpha").prefix_key == ""  # no affinity stays none
