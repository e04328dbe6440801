"""A batch's record (``Keys.batch``, a hash: state, owner, counts, the time it entered each state as
``t:<state>``, its deadline) read as a ``BatchInfo``. Its counts never drift: ``processing`` is
``total`` less the items recorded.
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import redis.asyncio as aioredis

from llamamesh.queue.keys import Keys
from llamamesh.queue.redisio import unreachable
from llamamesh.types import BatchInfo, BatchState

COUNTS = ("succeeded", "errored", "cancelled", "expired")


def info_of(raw: dict[bytes, bytes]) -> BatchInfo:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return BatchInfo(
        batch_id=f["id"],
        state=BatchState(f["state"]),
        owner=f.get("owner", ""),
        model=f.get("model", ""),
        total=int(f["total"]),
        completion_window_s=int(f.get("completion_window_s", "0")),
        created_at=_float(f.get("created_at")),
        expires_at=_float(f.get("expires_at")),
        **{c: int(f.get(c, "0")) for c in COUNTS},  # type: ignore[arg-type]
        times=MappingProxyType({k[2:]: float(v) for k, v in f.items() if k.startswith("t:")}),
        results_expire_at=_float(f.get("results_expire_at")),
        metadata=MappingProxyType(json.loads(f.get("metadata", "{}"))),
        prompt_tokens=int(f.get("prompt_tokens", "0")),
        completion_tokens=int(f.get("completion_tokens", "0")),
        cached_tokens=int(f.get("cached_tokens", "0")),
    )


async def read(client: aioredis.Redis, keys: Keys, batch_id: str) -> BatchInfo | None:
    """The batch's record (None: unknown, or purged). Raises QueueUnavailable."""
    with unreachable():
        raw: Any = await client.hgetall(keys.batch(batch_id))
    return info_of(raw) if raw and b"state" in raw else None


def pool_list(raw: Any) -> list[str]:
    """The pools a batch's record lists (its ``pools`` field, comma-separated; None: none)."""
    return [pool for pool in (raw or b"").decode().split(",") if pool]


def waits(info: BatchInfo) -> bool:
    """Whether the batch still waits for items (a failed batch waits for the ones that ran on)."""
    return not info.state.ended or (info.state is BatchState.FAILED and info.processing > 0)


def item_keys(keys: Keys, batch_id: str) -> list[str]:
    """The keys an item's result touches (record_result.lua, skip_unstarted.lua): meta, done,
    results, ids, started, and the HTTP door's link (given the batch's retention when it ends)."""
    return [
        keys.batch(batch_id),
        keys.batch_done(batch_id),
        keys.batch_results(batch_id),
        keys.batch_ids(batch_id),
        keys.batch_started(batch_id),
        keys.batch_link(batch_id),
    ]


def _float(raw: Any, default: float = 0.0) -> float:
    return float(raw) if raw is not None else default
