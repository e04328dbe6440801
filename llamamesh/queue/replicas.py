"""Writes a client is told about only once replicas have them: ``WAIT`` on the write's connection.

A submission, a Cancel, a batch's creation and its cancel wait, and a batch item's result before
its ack; events, leases, quotas and heartbeats do not (a loss of those is recovered otherwise).
What a failover can lose, and what WAIT guarantees: docs/guarantees.md, for operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from llamamesh.errors import QueueUnavailable
from llamamesh.settings import RedisSettings


@dataclass(frozen=True)
class Replicas:
    """How many replicas must acknowledge a write a client is told about, before it is told
    (``RedisSettings.wait_replicas``; 0: none, nothing waits), and for how long at most."""

    count: int = 0
    timeout_ms: int = 1000

    @classmethod
    def of(cls, settings: RedisSettings) -> Replicas:
        return cls(settings.wait_replicas, settings.wait_timeout_ms)

    def wait(self, pipe: Any) -> None:
        """Queue ``WAIT`` as ``pipe``'s last command (nothing when ``count`` is 0): it runs on the
        pipeline's connection right after the writes before it, and covers every write Redis
        applied before them (replication keeps their order)."""
        if self.count:
            pipe.wait(self.count, self.timeout_ms)

    def check(self, replies: Sequence[Any], what: str) -> list[Any]:
        """The pipeline's ``replies`` less WAIT's; raises QueueUnavailable when fewer than ``count``
        replicas acknowledged ``what`` (it stays on the primary)."""
        if not self.count:
            return list(replies)
        *rest, acked = replies
        if int(acked) < self.count:
            raise QueueUnavailable(
                f"{what} reached {int(acked)} of the {self.count} Redis replicas it needs within {self.timeout_ms} ms"
            )
        return rest

    async def script(self, client: aioredis.Redis, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """Run a registered ``script``: ``[its reply]``, or with ``count``, ``[its reply, WAIT's]``
        from one pipeline (the same connection); ``check`` them once the reply is judged."""
        if not self.count:
            return [await script(keys=list(keys), args=list(args))]
        async with client.pipeline(transaction=False) as pipe:
            await script(keys=list(keys), args=list(args), client=pipe)
            self.wait(pipe)
            return list(await pipe.execute())
