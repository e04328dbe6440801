"""The attempts log: the record of a caller's request (``Keys.attempts``, one JSON Attempt per
failover), its re-attach count (``Keys.attaches``) and how many read it now (``Keys.readers``).
They live as long as the request's events may: ``Retention.event_idle_s`` while it runs (its worker
renews the record and the readers as it publishes), the record ``Retention.event_s`` once its latest
attempt ended.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import redis.asyncio as aioredis

from llamamesh.queue.coalesce import ScriptPipe
from llamamesh.queue.keys import Keys, Retention
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.scripts import register
from llamamesh.types import Attempt, GenerationRequest


class AttemptsLog:
    def __init__(self, client: aioredis.Redis, keys: Keys, retention: Retention) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self._begin = register(client, "begin_attempt")
        self._ended = register(client, "attempt_ended")
        # Every request arriving together has its record written in one pipeline (coalesce.py).
        self._records = ScriptPipe(client)

    async def begin(self, caller_id: str, attempt: Attempt, first: bool) -> bool:
        """Append the attempt (begin_attempt.lua; ``first``: only if the request has none yet).
        Raises QueueUnavailable."""
        record = json.dumps(dataclasses.asdict(attempt))
        with unreachable():
            (done,) = await self._records.call(
                self._begin,
                keys=[self.keys.attempts(caller_id), self.keys.called_off(caller_id)],
                args=[record, "1" if first else "0", self.retention.event_idle_s],
            )
        return int(done) == 1

    async def forget(self, caller_id: str) -> None:
        with unreachable():
            await self._r.delete(self.keys.attempts(caller_id))

    async def attempts(self, caller_id: str) -> list[Attempt]:
        with unreachable():
            raw: Any = await self._r.lrange(self.keys.attempts(caller_id), 0, -1)
        return [_attempt(json.loads(r)) for r in raw]

    async def attach(self, caller_id: str) -> int:
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.incr(self.keys.attaches(caller_id))
                pipe.expire(self.keys.attaches(caller_id), self.retention.event_idle_s)
                n, _ = await pipe.execute()
        return int(n)

    async def attach_count(self, caller_id: str) -> int:
        with unreachable():
            n: Any = await self._r.get(self.keys.attaches(caller_id))
        return int(n or 0)

    async def reading(self, caller_id: str, delta: int) -> int:
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.incrby(self.keys.readers(caller_id), delta)
                pipe.expire(self.keys.readers(caller_id), self.retention.event_idle_s)
                n, _ = await pipe.execute()
        return int(n)

    def renew(self, pipe: Any, caller_id: str) -> None:
        """Queue on ``pipe`` the renewal of a running request's record and its count of readers (its
        worker publishes)."""
        pipe.expire(self.keys.attempts(caller_id), self.retention.event_idle_s)
        pipe.expire(self.keys.readers(caller_id), self.retention.event_idle_s)

    def ended(self, request: GenerationRequest, ttl: int) -> tuple[Any, list[str], list[Any]]:
        """The script call (for ``call_scripts``) that gives the caller's record the ``ttl`` of the
        events of the attempt that ended, if it is the latest (attempt_ended.lua)."""
        return self._ended, [self.keys.attempts(request.caller_id)], [request.request_id, ttl]

    async def close(self) -> None:
        await self._records.close()


def _attempt(record: dict[str, Any]) -> Attempt:
    """An attempts record as stored (JSON: its tuples are lists)."""
    for name in ("bases", "ended"):
        if name in record:
            record[name] = tuple(record[name])
    return Attempt(**record)
