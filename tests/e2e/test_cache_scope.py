"""The prefix cache scoped to the tenant on vLLM (the vLLM node runs LLAMAMESH_GATEWAY_CACHE_SCOPE=tenant):
a prompt one tenant sent reads as cached to that tenant's repeat, never to another tenant's first
request, whose engine request carries another cache salt (marker gpu: the CPU engine keeps no
prefix cache between requests)."""

from __future__ import annotations

import uuid

import pytest

from llamamesh.client import Client
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(300)]

# Some 300 tokens: many whole KV blocks (16 tokens each), new to the engine in every run.
TEXT = "The tenants share one engine but never one another's cached prompts. " * 20


async def cached_as(client: Client, tenant: str, prompt: str) -> tuple[int, int]:
    """(cached prompt tokens, prompt tokens) of ``prompt`` sent by ``tenant``."""
    req = pb.GenerateRequest(prompt=prompt, max_tokens=2, temperature=0.0)
    got = [m async for m in client.stub.Generate(req, metadata=(("x-llamamesh-tenant", tenant),))]
    return got[-1].usage.cached_tokens, got[-1].usage.prompt_tokens


@pytest.mark.parametrize("node", ["vllm"], indirect=True)  # the shared vLLM node alone
async def test_another_tenants_first_request_finds_nothing_cached(node: ProcessNode) -> None:
    prompt = f"Reference {uuid.uuid4().hex}. {TEXT}"
    async with Client(node.address) as client:
        first, prompt_tokens = await cached_as(client, "alpha", prompt)
        assert prompt_tokens > 200 and first == 0
        assert await cached_as(client, "beta", prompt) == (0, prompt_tokens)  # alpha's prompt, beta's first
        repeat, _ = await cached_as(client, "alpha", prompt)
        assert repeat >= prompt_tokens - 16, (repeat, prompt_tokens)  # all but the last partial block
        again, _ = await cached_as(client, "beta", prompt)
        assert again >= prompt_tokens - 16, (again, prompt_tokens)  # beta's own repeat is cached for beta
