"""The small job and the small batch the queue and worker tests submit."""

from __future__ import annotations

import time

from llamamesh.types import BatchInfo, BatchState, GenerationRequest, SamplingParams


def req(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt="p", sampling=SamplingParams(max_tokens=3))


def batch(
    bid: str, n: int, window_s: float = 3600, max_tokens: int | None = None
) -> tuple[BatchInfo, list[tuple[str, GenerationRequest]]]:
    """A batch of ``n`` items for the "cpu" pool (custom_ids c0, c1, ...) and its record, for
    ``BatchStore.create``."""
    now = time.time()
    info = BatchInfo(
        batch_id=bid,
        state=BatchState.VALIDATING,
        owner="t",
        model="m",
        total=n,
        completion_window_s=int(window_s),
        created_at=now,
        expires_at=now + window_s,
    )
    sampling = SamplingParams(max_tokens=max_tokens) if max_tokens is not None else SamplingParams()
    items = [
        (
            "cpu",
            GenerationRequest(
                request_id=f"b:{bid}:{i}", model="m", prompt="p", batch_id=bid, custom_id=f"c{i}", sampling=sampling
            ),
        )
        for i in range(n)
    ]
    return info, items
