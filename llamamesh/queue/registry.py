"""The registry of each pool's workers: their heartbeats (``Keys.worker``, listed in
``Keys.workers``), the work waiting for them, the consumers of the pool's groups that left, and with
prefix affinity on, which partitions each ready worker owns (``Keys.owners``; affinity.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from llamamesh.errors import QueueUnavailable
from llamamesh.queue import codec, groups
from llamamesh.queue.cluster import is_cluster
from llamamesh.queue.keys import WORKER_GROUP, Keys, Retention
from llamamesh.queue.lanes import BatchLanes
from llamamesh.queue.protocol import QueueDepth, split_ref
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.scripts import register
from llamamesh.queue.submit import WorkStreams
from llamamesh.types import WorkerStatus

log = structlog.get_logger(__name__)

# A gateway prunes each pool's consumers at most this often (the pool's workers() is asked every
# probe interval).
PRUNE_EVERY_S = 60.0


class WorkerRegistry:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, retention: Retention, work: WorkStreams, clock: Callable[[], float]
    ) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self._work = work
        self._lanes = BatchLanes(client, keys)
        self._clock = clock
        self._cluster = is_cluster(client)
        self._own = register(client, "own_partitions")
        self._touch = register(client, "touch_owned")
        # pool -> when its consumers were last pruned (clock seconds)
        self._pruned: dict[str, float] = {}
        # (pool, worker) -> the partitions it owned at its last heartbeat (affinity on)
        self._owned: dict[tuple[str, str], list[int]] = {}

    # ---- the gateway's side -------------------------------------------------
    async def workers(self, pool: str) -> list[WorkerStatus]:
        """The pool's live workers; stale names are forgotten, and at most every ``PRUNE_EVERY_S`` the
        pool's idle consumers too (``prune_consumers``). Raises QueueUnavailable."""
        idle_s = self.retention.consumer_idle_s
        if idle_s > 0:
            now = self._clock()
            if now - self._pruned.get(pool, -PRUNE_EVERY_S) >= min(PRUNE_EVERY_S, idle_s):
                self._pruned[pool] = now
                await self.prune_consumers(pool)
        names_key = self.keys.workers(pool)
        with unreachable():
            members: Any = await self._r.smembers(names_key)
            names = sorted(n.decode() for n in members)
            if not names:
                return []
            raw: Any = await self._r.mget([self.keys.worker(pool, n) for n in names])
            gone = [n for n, v in zip(names, raw, strict=True) if v is None]
            if gone:  # their heartbeats expired: forget the names too
                await self._r.srem(names_key, *gone)
        return [codec.decode_status(v) for v in raw if v is not None]

    async def queue_depth(self, pool: str) -> QueueDepth:
        """The pool's tenants (``keys.tenants``), then one pipeline of XLEN and the group's XPENDING
        summary of each of their work streams: an entry stays in its stream until acked, so waiting
        = length - leased. A stream or group not there counts as empty. Raises QueueUnavailable."""
        tenants = sorted((await self._work.tenants(pool)).keys() | {""})
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                for t, k in self._work.where(tenants):
                    stream = self.keys.work(pool, t, k)
                    pipe.xlen(stream)
                    pipe.xpending(stream, WORKER_GROUP)
                replies = await pipe.execute(raise_on_error=False)
        waiting = leased = 0
        for length, summary in zip(replies[::2], replies[1::2], strict=True):
            if isinstance(length, BaseException):
                raise QueueUnavailable("cannot read the work stream") from length
            held = 0
            if isinstance(summary, BaseException):
                if not groups.gone(summary):  # NOGROUP: the stream or its group is not there
                    raise QueueUnavailable("cannot read the work stream") from summary
            else:
                held = int(summary["pending"])
            waiting += max(0, int(length) - held)
            leased += held
        return QueueDepth(waiting, leased)

    async def prune_consumers(self, pool: str) -> int:
        """Remove the consumers of the pool's work streams (every tenant's) and batch lanes (a
        bounded window of them each call, going round: ``BatchLanes.open_streams``) that hold no
        entry and were idle for ``Retention.consumer_idle_s`` (dead or restarted workers' names);
        returns how many. Then forget the tenants whose work streams hold nothing.
        Raises QueueUnavailable."""
        idle_s = self.retention.consumer_idle_s
        tenants = sorted((await self._work.tenants(pool)).keys() | {""})
        n = 0
        streams = [self.keys.work(pool, t, k) for t, k in self._work.where(tenants)]
        for stream in (*streams, *await self._lanes.open_streams(pool)):
            n += await groups.prune_consumers(self._r, stream, idle_s * 1000)
        if n:
            log.info("consumers_pruned", pool=pool, count=n, idle_s=idle_s)
        if forgotten := await self._work.forget_idle(pool, tenants):
            log.info("tenants_idle", pool=pool, tenants=forgotten)
        return n

    # ---- the worker's side --------------------------------------------------
    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> list[str]:
        """The worker's status for ``ttl_s`` in one round trip; with affinity on, in the same one, a
        ready worker renews and rebalances its partitions (own_partitions.lua, for ``ttl_s``) and
        any other gives them up; off, the pool must have no partitions recorded. Either way a
        mismatch raises QueueMisconfigured. Then its jobs (``touch``) touched, in one more: returns
        those another worker took over meanwhile (``groups.touch_owned``)."""
        pool, parts = status.pool, self._work.partitions
        own_keys = [self.keys.owners(pool), self.keys.partitions(pool)]
        own_args: list[Any] = [status.worker, int(ttl_s * 1000), parts, "own" if status.ready else "leave"]
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.worker(pool, status.worker), codec.encode_status(status), px=int(ttl_s * 1000))
                pipe.sadd(self.keys.workers(pool), status.worker)
                if not parts:
                    pipe.exists(self.keys.partitions(pool))
                elif not self._cluster:
                    await self._own(keys=own_keys, args=own_args, client=pipe)
                replies = await pipe.execute(raise_on_error=False)
            if parts and self._cluster:  # a cluster pipeline refuses scripts: its own call
                try:
                    replies.append(await self._own(keys=own_keys, args=own_args))
                except ResponseError as exc:
                    replies.append(exc)
            for reply in replies[:-1]:
                if isinstance(reply, BaseException):
                    raise reply
        await self._owns(pool, status.worker, replies[-1])
        by_stream: dict[str, dict[str, str]] = {}
        for ref in touch:
            tenant, k, eid = split_ref(ref)
            by_stream.setdefault(self.keys.work(pool, tenant, k), {})[eid] = ref
        return await groups.touch_owned(self._r, self._touch, status.worker, by_stream)

    async def _owns(self, pool: str, worker: str, reply: Any) -> None:
        """Note the partitions the heartbeat's last reply says the worker owns (affinity on), or
        raise QueueMisconfigured when the pool's recorded partitions are not this process's."""
        if isinstance(reply, BaseException):
            raise QueueUnavailable(f"cannot record the worker's partitions: {reply}") from reply
        parts = self._work.partitions
        if parts and int(reply[0]) == 0:
            self._owned[(pool, worker)] = sorted(int(k) for k in reply[1:])
        elif parts or int(reply):
            self._owned.pop((pool, worker), None)
            await self._work.misconfigured(pool)

    def owned(self, pool: str, worker: str) -> list[int]:
        """The partitions the worker owned at its last heartbeat through this queue (affinity on)."""
        return list(self._owned.get((pool, worker), ()))

    async def leave(self, pool: str, worker: str) -> None:
        """Withdraw the worker's heartbeat, and give up its partitions (affinity on): the others take
        them at once."""
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.worker(pool, worker))
                pipe.srem(self.keys.workers(pool), worker)
                await pipe.execute()
            if self._work.partitions:
                await self._own(
                    keys=[self.keys.owners(pool), self.keys.partitions(pool)],
                    args=[worker, 0, self._work.partitions, "leave"],
                )
        self._owned.pop((pool, worker), None)
