"""The gateway's reader of streams (``EventFollower``): one blocking XREAD for every stream it follows
(a request's events for the relay, a batch's results for ``RedisBatches.results``), not one read and
one held connection per stream. A new follower wakes the blocked read through a wake stream private
to this follower, so that the next read includes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any  # redis-py types stream replies loosely

import redis.asyncio as aioredis
import structlog
from redis.crc import key_slot
from redis.exceptions import RedisError

from llamamesh.backoff import Delays
from llamamesh.errors import QueueUnavailable
from llamamesh.queue.keys import WAKE_FIELD, Keys, Retention
from llamamesh.queue.protocol import entry_order
from llamamesh.queue.redisio import is_cluster, unreachable

log = structlog.get_logger(__name__)

Item = tuple[str, dict[bytes, bytes]] | BaseException
# How long past its block time a lane's read may take before it counts as Redis not answering.
READ_SLACK_S = 3.0


class Inbox:
    """A follower's entries as they arrive: asyncio.Queue's put_nowait / get / get_nowait / empty,
    plus ``get_within``, which also returns (None) when nothing came for a while without a timer
    or a task per entry: one timer per idle period, re-armed lazily (a relayed request waits for
    hundreds of entries per liveness check; wait_for would cost a timer and a task each)."""

    __slots__ = ("_got_at", "_items", "_loop", "_timer", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._got_at = 0.0  # loop time of the last entry (or of the last idle return)

    def put_nowait(self, item: Item) -> None:
        self._items.append(item)
        if self._loop is not None:
            self._got_at = self._loop.time()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Item:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Item:
        while not self._items:
            await self._wait()
        return self._items.popleft()

    async def get_within(self, idle_s: float) -> Item | None:
        """The next entry, or None when ``idle_s`` passed since the last one (or the last None)."""
        if not self._items:
            loop = self._loop = self._loop or asyncio.get_running_loop()
            if not self._got_at:
                self._got_at = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._got_at + idle_s, self._idle, idle_s)
            await self._wait()
            if not self._items:
                return None
        return self._items.popleft()

    async def _wait(self) -> None:
        fut = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            self._waiter = None

    def _idle(self, idle_s: float) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done() or self._loop is None:
            return  # nobody waits: the next get_within arms it again
        left = self._got_at + idle_s - self._loop.time()
        if left > 0:  # an entry came meanwhile: the idle period starts from it
            self._timer = self._loop.call_later(left, self._idle, idle_s)
        else:
            self._got_at = self._loop.time()
            w.set_result(None)

    def close(self) -> None:
        """Drop the idle timer (the reader is done)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclass(eq=False)
class Follower:
    """One reader of one stream: entries after ``last`` arrive on ``queue``."""

    key: str
    last: str
    queue: Inbox = field(default_factory=Inbox)


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: the text between the first ``{`` and the next ``}``
    when not empty, else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


class EventFollower:
    """One blocking read per lane (one lane on a single Redis, one per slot on a cluster) for every
    stream followed through it; ``follow`` a stream, ``unfollow`` it, ``close`` at the end.

    On a Redis Cluster, whose XREAD names keys of one slot, a lane is a read and a wake stream per
    slot; request event streams are spread over ``Keys.event_shards`` slots, so a gateway holds at
    most that many event reads. While Redis is unreachable the lanes retry and followers keep their
    place; only an outage longer than ``outage_grace_s`` reaches them, as ``QueueUnavailable``."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        block_ms: int,
        wake_ttl_s: int = Retention.event_idle_s,
        outage_grace_s: float = 0.0,
    ) -> None:
        self._r = client
        self._keys = keys
        self._id = uuid.uuid4().hex
        self._cluster = is_cluster(client)
        self._outage_grace_s = outage_grace_s
        self._block_ms = block_ms
        self._wake_ttl_s = wake_ttl_s
        # slot (cluster) or 0 -> its lane
        self._lanes: dict[int, _Lane] = {}
        self._closing = False

    @property
    def reads(self) -> int:
        """How many XREADs returned, over every lane."""
        return sum(lane.reads for lane in self._lanes.values())

    @property
    def followers(self) -> int:
        """How many followers are registered."""
        return sum(lane.followers for lane in self._lanes.values())

    @property
    def lanes(self) -> int:
        """How many blocking reads this follower keeps (one per slot on a cluster)."""
        return len(self._lanes)

    async def follow(self, key: str, after: str = "0-0") -> Follower:
        """Start following ``key`` after ``after``. Raises QueueUnavailable if the wake-up cannot be sent."""
        if self._closing:
            raise QueueUnavailable("the event follower is closed")
        slot = key_slot(key.encode()) if self._cluster else 0
        lane = self._lanes.get(slot)
        if lane is None:
            wake = self._keys.wake(self._id, hash_tag(key) if self._cluster else "")
            lane = self._lanes[slot] = _Lane(self, wake)
        return await lane.follow(key, after)

    def unfollow(self, sub: Follower) -> None:
        slot = key_slot(sub.key.encode()) if self._cluster else 0
        lane = self._lanes.get(slot)
        if lane is not None:
            lane.unfollow(sub)

    async def close(self) -> None:
        self._closing = True
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            await lane.close()


class _Lane:
    """The followers of one slot (of everything, on a single Redis): one loop, one blocking XREAD."""

    def __init__(self, owner: EventFollower, wake_key: str) -> None:
        self._o = owner
        self._wake_key = wake_key
        self._wake_last = "0-0"
        self._subs: dict[str, list[Follower]] = {}
        self._reading = False
        # A wake-up was sent (or is being sent) since the loop last built its read.
        self._woken = False
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.reads = 0

    @property
    def followers(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    async def follow(self, key: str, after: str) -> Follower:
        sub = Follower(key, after)
        self._subs.setdefault(key, []).append(sub)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-follower")
        if self._reading:
            # Registered before the wake entry is written, and the read takes the wake stream from
            # the id it last saw: no new follower is missed. A burst of them shares one wake-up.
            if self._woken:  # the wake-up on its way returns the read; the next one includes this
                return sub
            self._woken = True
            try:
                with unreachable():
                    async with self._o._r.pipeline(transaction=False) as pipe:
                        pipe.xadd(self._wake_key, {WAKE_FIELD: b"1"}, maxlen=16, approximate=True)
                        pipe.expire(self._wake_key, self._o._wake_ttl_s)
                        await pipe.execute()
            except QueueUnavailable:
                self._woken = False
                self.unfollow(sub)
                raise
        else:
            self._idle.set()
        return sub

    def unfollow(self, sub: Follower) -> None:
        sub.queue.close()
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
            # redis-py's cluster client may raise from a read cancelled while it connects.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError):
            await self._o._r.delete(self._wake_key)

    async def _run(self) -> None:
        delays = Delays()
        down_since: float | None = None
        r = self._o._r
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
                streams[key] = min((s.last for s in subs), key=entry_order)
            try:
                # Bounded: a Redis that stopped answering without closing (a paused or hung host) would
                # hold the read for the socket timeout at each of the client's retries, past the grace.
                read = r.xread(streams, count=1024, block=self._o._block_ms)
                reply: Any = await asyncio.wait_for(read, self._o._block_ms / 1000 + READ_SLACK_S)
                delays.reset()
                if down_since is not None:
                    down_s = round(time.monotonic() - down_since, 2)
                    log.info("event_read_recovered", followers=len(self._subs), down_s=down_s)
                    down_since = None
            except Exception as exc:  # RedisError, or a client's own fault mid-failover: a lane never dies of it
                if self._closing:
                    return
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if now - down_since >= self._o._outage_grace_s:  # too long: tell every follower
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
                start = entry_order(streams[key]) if key in streams else None
                for sub in self._subs.get(key, ()):
                    if start is None or entry_order(sub.last) < start:
                        # It came after this read was made, from further on than its own place: what
                        # lies between would be skipped. The next read starts from its place.
                        continue
                    for raw_id, fields in entries:
                        entry_id = raw_id.decode()
                        if entry_order(entry_id) > entry_order(sub.last):
                            sub.last = entry_id
                            sub.queue.put_nowait((entry_id, fields))
