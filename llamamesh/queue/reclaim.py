"""Reclaim: a worker takes over jobs another left leased and untouched (it died), and the pool's
dead-letter stream (``Keys.dead_letters``) where a job goes once too many workers died running it
(its caller gets a failure).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import redis.asyncio as aioredis
import structlog

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import codec, groups
from llamamesh.queue.cancels import CancelFlags
from llamamesh.queue.keys import EVENT_FIELD, JOB_FIELD, WORKER_GROUP, Keys, Retention
from llamamesh.queue.lease import Leasing
from llamamesh.queue.protocol import Lease, entry_ref
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.submit import WorkStreams
from llamamesh.types import Failure, GenerationRequest, JobEvent

log = structlog.get_logger(__name__)

# (tenant, partition or None): one work stream of a pool.
_Stream = tuple[str, int | None]


class Reclaimer:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retention: Retention,
        work: WorkStreams,
        leasing: Leasing,
        flags: CancelFlags,
    ) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self._work = work
        self._leasing = leasing
        self._flags = flags

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
        """Each of the pool's work streams (every tenant's): XPENDING, then XCLAIM of up to ``count``
        stale entries in all, one pipeline each; a job delivered more than ``max_deliveries`` times
        goes to the dead letters, unless it was cancelled (its gateway moved it on, or set it aside
        itself): that one comes back for the worker to skip. Raises QueueUnavailable."""
        with unreachable("cannot reclaim from the work stream"):
            delivered = await self._stale(pool, consumer, min_idle_ms, count, own, running)
            if not delivered:
                return []
            entries = await self._claimed(pool, consumer, 0 if own else min_idle_ms, delivered)
        leases: list[Lease] = []
        times: list[int] = []
        for (t, k), eid, fields in entries:
            try:
                req = codec.decode_job(fields[JOB_FIELD.encode()])
            except (InvalidRequest, KeyError):
                await groups.drop(self._r, self.keys.work(pool, t, k), [eid])
                continue
            leases.append(Lease(pool=pool, entry_id=eid, request=req, tenant=t, partition=k))
            times.append(delivered[(t, k)].get(eid, 1))
        taken: list[Lease] = []
        for lease, n in zip(await self._flags.flagged(leases, reclaimed=True), times, strict=True):
            if n <= max_deliveries or lease.cancelled:
                taken.append(lease)
                continue
            reason = f"the {n - 1} workers that took it died"
            await self.dead_letter(pool, lease.entry_id, lease.request, reason, n, lease.tenant, lease.partition)
        log.info("jobs_reclaimed", pool=pool, count=len(taken), dead=len(leases) - len(taken), own=own)
        return taken

    async def _stale(
        self, pool: str, consumer: str, min_idle_ms: int, count: int, own: bool, running: Collection[str]
    ) -> dict[_Stream, dict[str, int]]:
        """Up to ``count`` entries to claim, stream -> entry id -> its delivery count once claimed:
        idle ``min_idle_ms`` or more (this consumer's own too, unless it runs them: a lease whose
        reply was lost), or with ``own`` every one this consumer holds."""
        where = self._work.where((await self._leasing.fair_share(pool)).tenants)
        async with self._r.pipeline(transaction=False) as pipe:
            for t, k in where:
                pipe.xpending_range(
                    self.keys.work(pool, t, k),
                    WORKER_GROUP,
                    min="-",
                    max="+",
                    count=count,
                    consumername=consumer if own else None,
                    idle=None if own else min_idle_ms,
                )
            pending = await pipe.execute(raise_on_error=False)
        delivered: dict[_Stream, dict[str, int]] = {}
        n = 0
        for (t, k), stale in zip(where, pending, strict=True):
            if isinstance(stale, BaseException):
                if not groups.gone(stale):
                    raise stale
                continue
            for p in stale:
                eid = p["message_id"].decode()
                if n < count and (own or entry_ref(t, eid, k) not in running):
                    delivered.setdefault((t, k), {})[eid] = int(p["times_delivered"]) + 1
                    n += 1
        return delivered

    async def _claimed(
        self, pool: str, consumer: str, min_idle_ms: int, delivered: dict[_Stream, dict[str, int]]
    ) -> list[tuple[_Stream, str, Any]]:
        """XCLAIM of the ``delivered`` entries with a minimum idle time: of several reclaimers, the
        first one resets the idle time and takes the job; the others get nothing for it. Returns
        (stream, entry id, fields) of each still there."""
        async with self._r.pipeline(transaction=False) as pipe:
            for (t, k), ids in delivered.items():
                pipe.xclaim(self.keys.work(pool, t, k), WORKER_GROUP, consumer, min_idle_ms, list(ids))
            claims = await pipe.execute(raise_on_error=False)
        entries: list[tuple[_Stream, str, Any]] = []
        for where, claimed in zip(delivered, claims, strict=True):
            if isinstance(claimed, BaseException):
                if not groups.gone(claimed):
                    raise QueueUnavailable(f"cannot reclaim from the work stream: {claimed}") from claimed
                continue
            entries += [(where, eid.decode(), fields) for eid, fields in claimed if fields]
        return entries

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
        """Move a poison job to the pool's dead-letter stream (with ``reason``), tell its caller
        (a terminal failure on its events), and drop it from its work stream (``tenant``'s, or its
        ``partition`` of it)."""
        failed = JobEvent(failed=Failure(code="set_aside", message=f"the job was set aside: {reason}", retryable=False))
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                self._dead_record(pipe, pool, request, reason, deliveries)
                events = self.keys.events(request.request_id)
                pipe.xadd(events, {EVENT_FIELD: codec.encode_event(failed)})
                pipe.expire(events, self.retention.event_s)
                groups.ack(pipe, self.keys.work(pool, tenant, partition), entry_id)
                await pipe.execute()
        log.error("job_dead_lettered", pool=pool, request_id=request.request_id, reason=reason, deliveries=deliveries)

    async def set_aside(self, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                self._dead_record(pipe, pool, request, reason, deliveries)
                await pipe.execute()
        log.error("job_dead_lettered", pool=pool, request_id=request.request_id, reason=reason, deliveries=deliveries)

    def _dead_record(self, pipe: Any, pool: str, request: GenerationRequest, reason: str, deliveries: int) -> None:
        fields = {JOB_FIELD: codec.encode_job(request), "reason": reason, "deliveries": deliveries}
        most = self.retention.dead_letters or None
        pipe.xadd(self.keys.dead_letters(pool), fields, maxlen=most, approximate=True)
