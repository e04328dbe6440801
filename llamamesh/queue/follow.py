"""The gateway's reader of streams: one blocking XREAD for every stream it follows (a request's
events for the relay, a batch's results for ``RedisBatches.results``).

Following each request with its own blocking XREAD costs one Redis round trip (and one held
connection) per event per request. The follower instead keeps one loop that XREADs every
followed stream at once, plus a wake stream private to this follower: registering a new request
appends to the wake stream, which returns the blocked XREAD at once so the next one includes the
new stream. There is no window in which a new follower can be missed: its registration happens
before the wake entry is written, and the XREAD reads the wake stream from the id it last saw.
Registrations that find a wake-up already on its way since the loop last built its read send none
of their own: that one returns the read, and the next includes them (so a burst of registrations
costs one write and one connection, not one each).

While Redis is unreachable the loop backs off and retries, and the followers keep their place: when
it answers again (a restart from its AOF, a failover) they read on from their last entry. Only an
outage longer than ``outage_grace_s`` reaches every follower, as ``QueueUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any  # redis-py types stream replies loosely

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from llamamesh.backoff import Delays
from llamamesh.errors import QueueUnavailable
from llamamesh.queue.keys import WAKE_FIELD, Keys
from llamamesh.queue.redisio import unreachable

log = structlog.get_logger(__name__)

Item = tuple[str, dict[bytes, bytes]] | BaseException


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Follower:
    """One reader of one stream: entries after ``last`` arrive on ``queue``."""

    key: str
    last: str
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)


class EventFollower:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, block_ms: int, wake_ttl_s: int = 3600, outage_grace_s: float = 0.0
    ) -> None:
        self._r = client
        self._outage_grace_s = outage_grace_s
        self._block_ms = block_ms
        self._wake_key = keys.wake(uuid.uuid4().hex)
        self._wake_ttl_s = wake_ttl_s
        self._wake_last = "0-0"
        self._subs: dict[str, list[Follower]] = {}
        self._reading = False
        # A wake-up was sent (or is being sent) since the loop last built its read.
        self._woken = False
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.reads = 0

    async def follow(self, key: str, after: str = "0-0") -> Follower:
        """Start following ``key`` after ``after``. Raises QueueUnavailable if the wake-up cannot be sent."""
        sub = Follower(key, after)
        self._subs.setdefault(key, []).append(sub)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-follower")
        if self._reading:
            if self._woken:  # the wake-up on its way returns the read; the next one includes this
                return sub
            self._woken = True
            try:
                with unreachable():
                    async with self._r.pipeline(transaction=False) as pipe:
                        pipe.xadd(self._wake_key, {WAKE_FIELD: b"1"}, maxlen=16, approximate=True)
                        pipe.expire(self._wake_key, self._wake_ttl_s)
                        await pipe.execute()
            except QueueUnavailable:
                self._woken = False
                self.unfollow(sub)
                raise
        else:
            self._idle.set()
        return sub

    @property
    def followers(self) -> int:
        """How many followers are registered."""
        return sum(len(subs) for subs in self._subs.values())

    def unfollow(self, sub: Follower) -> None:
        subs = self._subs.get(sub.key)
        if subs is not None and sub in subs:
            subs.remove(sub)
            if not subs:
                del self._subs[sub.key]

    async def close(self) -> None:
        # The flag, not only the cancel: redis-py may turn a cancelled blocking read into a RedisError.
        self._closing = True
        self._idle.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError):
            await self._r.delete(self._wake_key)

    async def _run(self) -> None:
        delays = Delays()
        down_since: float | None = None
        while not self._closing:
            if not self._subs:
                self._reading = False
                self._idle.clear()
                await self._idle.wait()
                continue
            self._reading = True
            self._woken = False  # registered from now on: not in this read, so they wake it
            streams: dict[Any, Any] = {self._wake_key: self._wake_last}
            for key, subs in self._subs.items():
                streams[key] = min((s.last for s in subs), key=_id)
            try:
                reply: Any = await self._r.xread(streams, count=1024, block=self._block_ms)
                delays.reset()
                if down_since is not None:
                    down_s = round(time.monotonic() - down_since, 2)
                    log.info("event_read_recovered", followers=len(self._subs), down_s=down_s)
                    down_since = None
            except RedisError as exc:
                if self._closing:
                    return
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since >= self._outage_grace_s:  # too long: tell every follower
                    log.warning("event_read_failed", followers=len(self._subs), error=str(exc))
                    for subs in list(self._subs.values()):
                        for s in subs:
                            s.queue.put_nowait(exc)
                    self._subs.clear()
                    down_since = None
                else:
                    log.warning("event_read_retrying", followers=len(self._subs), error=str(exc))
                await delays.wait()
                continue
            self.reads += 1
            for raw_key, entries in reply or ():
                key = raw_key.decode()
                if key == self._wake_key:
                    self._wake_last = entries[-1][0].decode()
                    continue
                for sub in self._subs.get(key, ()):
                    for raw_id, fields in entries:
                        entry_id = raw_id.decode()
                        if _id(entry_id) > _id(sub.last):
                            sub.last = entry_id
                            sub.queue.put_nowait((entry_id, fields))
