"""The small job the queue tests submit."""

from __future__ import annotations

from llamamesh.types import GenerationRequest, SamplingParams


def req(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt="p", sampling=SamplingParams(max_tokens=3))
