"""The workers' consumer group on a stream (a pool's work streams, its batch stream): made, its
entries touched (while their consumer still holds them), acked and dropped, its idle consumers
pruned, and what a read that finds it gone looks like.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from llamamesh.queue.keys import WORKER_GROUP
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.queue.scripts import source


def gone(exc: BaseException) -> bool:
    """A read of a stream that is not there (deleted with its group: Redis lost its data, or the
    tenant was forgotten; a blocked read learns it as UNBLOCKED)."""
    return isinstance(exc, ResponseError) and ("NOGROUP" in str(exc) or "UNBLOCKED" in str(exc))


async def create_group(client: aioredis.Redis, stream: str) -> bool:
    """The workers' consumer group on ``stream`` (and the stream), unless it exists; True when it
    did not."""
    with unreachable("cannot create the consumer group"):
        try:
            await client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
    return True


async def touch_owned(client: aioredis.Redis, script: Any, consumer: str, refs: dict[str, dict[str, str]]) -> list[str]:
    """Reset the idle time of the entries ``consumer`` still holds, so that nobody reclaims them
    (touch_owned.lua, one call per stream: ``refs`` maps each stream to its entry ids, each with the
    caller's name for it). Returns the names of those another consumer took over meanwhile (it
    could not touch them for the claim idle time: paused, or cut off from Redis): the caller must
    stop running them, for their new consumer does. Raises QueueUnavailable."""
    streams = [s for s, ids in refs.items() if ids]
    calls = [(script, [s], [WORKER_GROUP, consumer, *refs[s]]) for s in streams]
    with unreachable():
        replies = await call_scripts(client, calls)
    return [refs[s][eid.decode()] for s, lost in zip(streams, replies, strict=True) for eid in lost]


def ack(pipe: Any, stream: str, *entry_ids: str) -> None:
    """Queue on ``pipe`` the ack and the delete of entries done with (XACK, XDEL)."""
    pipe.xack(stream, WORKER_GROUP, *entry_ids)
    pipe.xdel(stream, *entry_ids)


async def drop(client: aioredis.Redis, stream: str, entry_ids: Sequence[str]) -> None:
    """Ack and delete entries (done with, or undecodable). Raises QueueUnavailable."""
    with unreachable():
        async with client.pipeline(transaction=False) as pipe:
            ack(pipe, stream, *entry_ids)
            await pipe.execute()


async def prune_consumers(client: aioredis.Redis, stream: str, idle_ms: int) -> int:
    """Remove the workers' group consumers of ``stream`` that hold no entry and were idle for
    ``idle_ms`` or more (a missing stream or group: none); returns how many. Nothing leased is lost:
    a consumer holding entries stays. Raises QueueUnavailable."""
    with unreachable():
        return int(await client.eval(source("prune_consumers"), 1, stream, WORKER_GROUP, idle_ms))
