"""The queue on Redis Streams: ``RedisQueue``, both faces (``JobQueue`` and ``WorkQueue``) on one
connection pool, composed of one part per role: submit.py (submission, the pools' work streams and
their affinity partitions), events.py (a request's event stream), cancels.py (its cancel flags),
attempts.py (the record of a caller's request), lease.py (leasing by fair share and affinity),
reclaim.py (reclaim and the dead letters), registry.py (heartbeats, depth, consumers, affinity
ownership), adapters.py (run-time LoRA adapters). Keys come from keys.py, lifetimes from
``Retention``, scripts from lua/; Redis errors become ``QueueUnavailable`` in the queue layer only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from llamamesh.errors import QueueRefused, QueueUnavailable
from llamamesh.queue.adapters import AdapterTable
from llamamesh.queue.attempts import AttemptsLog
from llamamesh.queue.cancels import CancelFlags
from llamamesh.queue.events import EventStreams
from llamamesh.queue.groups import create_group, prune_consumers, touch_owned
from llamamesh.queue.keys import Keys, Retention
from llamamesh.queue.lease import Leasing
from llamamesh.queue.protocol import Lease, QueueDepth
from llamamesh.queue.reclaim import Reclaimer
from llamamesh.queue.redisio import connect, evicting, refusal, unreachable
from llamamesh.queue.registry import WorkerRegistry
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.slots import shard_tags
from llamamesh.queue.submit import WorkStreams
from llamamesh.settings import RedisSettings
from llamamesh.types import Attempt, GenerationRequest, JobEvent, WorkerStatus

# Also importable from here, where callers outside the queue's roles look for them.
__all__ = ["RedisQueue", "create_group", "prune_consumers", "touch_owned"]

# Seconds a process's start gives Redis to say whether it takes it (``RedisQueue.refused``).
PREFLIGHT_S = 5.0


class RedisQueue:
    """Both faces of the queue (JobQueue and WorkQueue) on one Redis connection pool: each call is
    its role's (the module docstring says whose)."""

    def __init__(
        self, client: aioredis.Redis, settings: RedisSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._r = client
        self.keys = Keys(settings.prefix, settings.event_shards)
        shard_tags(settings.event_shards)  # a bad count fails here, at start, not at the first request
        self.retention = Retention.of(settings)
        self.replicas = Replicas.of(settings)
        r, keys, kept = client, self.keys, self.retention
        self._work = WorkStreams(
            r,
            keys,
            kept,
            self.replicas,
            settings.affinity_partitions,
            settings.affinity_placement,
            settings.affinity_placement_ttl_s,
        )
        self._flags = CancelFlags(r, keys, kept, self.replicas)
        self._attempts = AttemptsLog(r, keys, kept)
        self._events = EventStreams(
            r, keys, kept, self._flags, self._attempts, clock, settings.block_ms, settings.outage_grace_s
        )
        self._registry = WorkerRegistry(r, keys, kept, self._work, clock)
        self._leasing = Leasing(
            r, keys, self._work, self._flags, self._registry.owned, clock, settings.affinity_steal_after_ms
        )
        self._reclaimer = Reclaimer(r, keys, kept, self._work, self._leasing, self._flags)
        self._adapters = AdapterTable(r, keys)

    @property
    def client(self) -> aioredis.Redis:
        """The connection pool, for the batch store (llamamesh/queue/batches.py) to share."""
        return self._r

    @classmethod
    def from_settings(cls, settings: RedisSettings) -> RedisQueue:
        return cls(connect(settings), settings)

    # ---- the queue's state --------------------------------------------------
    async def ping(self) -> None:
        with unreachable():
            await self._r.ping()

    async def epoch(self) -> str:
        with unreachable():
            value: Any = await self._r.get(self.keys.epoch())
            if value is None:  # (a read first: a full Redis refuses the write even when the key is there)
                await self._r.set(self.keys.epoch(), f"{uuid.uuid4().hex}@{time.time():.0f}", nx=True)
                value = await self._r.get(self.keys.epoch())
        return value.decode() if value else ""

    async def check_writes(self) -> None:
        with unreachable():
            await self._r.set(self.keys.write_probe(), b"1", ex=self.retention.write_probe_s)

    async def preflight(self) -> None:
        with unreachable():
            await self._r.eval("return 1", 0)
            try:  # (an ACL may allow scripts and streams but not this: claiming a dead worker's jobs)
                await self._r.xautoclaim(self.keys.write_probe(), "preflight", "preflight", 0)
            except ResponseError as exc:
                if refusal(exc):
                    raise
                # NOGROUP or WRONGTYPE: the command is allowed

    async def refused(self, timeout_s: float = PREFLIGHT_S) -> QueueRefused | None:
        """How Redis refuses this client what the queue needs (``preflight``'s error), for a process's start; None
        when it takes it, or does not answer within ``timeout_s`` (it may come up later: then it is waited for)."""
        try:
            await asyncio.wait_for(self.preflight(), timeout_s)
        except QueueRefused as exc:
            return exc
        except (QueueUnavailable, asyncio.TimeoutError):
            pass
        return None

    async def eviction(self) -> str:
        with unreachable():
            try:
                info: Any = await self._r.info("memory")
            except ResponseError:  # INFO renamed or refused (a managed Redis's ACL): it does not say
                return ""
        return evicting(info)

    async def close(self) -> None:
        await self._events.close()
        await self._attempts.close()
        await self._work.close()
        await self._r.aclose()

    # ---- submission, events, cancels (submit.py, events.py, cancels.py) -----
    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        await self._work.submit(pool, request, max_waiting, weight)

    async def queued(self, pool: str, request_id: str) -> bool:
        return await self._work.queued(pool, request_id)

    def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        return self._events.events(request_id, after)

    def events_within(
        self, request_id: str, idle_s: float, after: str = "0-0"
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        return self._events.followed(request_id, after, idle_s)

    async def end(self, request_id: str, event: JobEvent) -> None:
        await self._events.end(request_id, event)

    async def read_events(self, request_id: str) -> list[tuple[str, JobEvent]]:
        return await self._events.read_events(request_id)

    async def last_event(self, request_id: str) -> tuple[int, JobEvent | None]:
        return await self._events.last_event(request_id)

    async def publish(self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]) -> set[str]:
        return await self._events.publish(events, watch)

    async def cancel(self, request_id: str) -> None:
        await self._flags.cancel(request_id)

    async def call_off(self, caller_id: str) -> None:
        await self._flags.call_off(caller_id)

    # ---- the attempts log (attempts.py) --------------------------------------
    async def begin(self, caller_id: str, attempt: Attempt, first: bool) -> bool:
        return await self._attempts.begin(caller_id, attempt, first)

    async def forget(self, caller_id: str) -> None:
        await self._attempts.forget(caller_id)

    async def attempts(self, caller_id: str) -> list[Attempt]:
        return await self._attempts.attempts(caller_id)

    async def attach(self, caller_id: str) -> int:
        return await self._attempts.attach(caller_id)

    async def attach_count(self, caller_id: str) -> int:
        return await self._attempts.attach_count(caller_id)

    async def reading(self, caller_id: str, delta: int) -> int:
        return await self._attempts.reading(caller_id, delta)

    # ---- leasing and reclaim (lease.py, reclaim.py) --------------------------
    async def join(self, pool: str) -> None:
        await self._work.join(pool)

    async def lease(
        self, pool: str, consumer: str, count: int, block_ms: int, exclude: Collection[str] = ()
    ) -> list[Lease]:
        return await self._leasing.lease(pool, consumer, count, block_ms, exclude)

    async def reclaim(
        self,
        pool: str,
        consumer: str,
        min_idle_ms: int,
        count: int,
        max_deliveries: int,
        own: bool = False,
        running: Collection[str] = (),
    ) -> list[Lease]:
        return await self._reclaimer.reclaim(pool, consumer, min_idle_ms, count, max_deliveries, own, running)

    async def dead_letter(
        self,
        pool: str,
        entry_id: str,
        request: GenerationRequest,
        reason: str,
        deliveries: int,
        tenant: str = "",
        partition: int | None = None,
    ) -> None:
        await self._reclaimer.dead_letter(pool, entry_id, request, reason, deliveries, tenant, partition)

    async def set_aside(self, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        await self._reclaimer.set_aside(pool, request, reason, deliveries)

    # ---- the registry of workers (registry.py) -------------------------------
    async def workers(self, pool: str) -> list[WorkerStatus]:
        return await self._registry.workers(pool)

    async def queue_depth(self, pool: str) -> QueueDepth:
        return await self._registry.queue_depth(pool)

    async def prune_consumers(self, pool: str) -> int:
        return await self._registry.prune_consumers(pool)

    async def heartbeat(self, status: WorkerStatus, ttl_s: float, touch: Sequence[str] = ()) -> list[str]:
        return await self._registry.heartbeat(status, ttl_s, touch)

    def owned(self, pool: str, worker: str) -> list[int]:
        return self._registry.owned(pool, worker)

    async def leave(self, pool: str, worker: str) -> None:
        await self._registry.leave(pool, worker)

    # ---- run-time adapters (adapters.py) -------------------------------------
    async def adapters(self, pool: str) -> dict[str, str]:
        return await self._adapters.adapters(pool)

    async def set_adapter(self, pool: str, name: str, path: str) -> None:
        await self._adapters.set_adapter(pool, name, path)

    async def drop_adapter(self, pool: str, name: str) -> None:
        await self._adapters.drop_adapter(pool, name)
