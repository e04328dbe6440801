"""Submission and the pool's work streams (``WorkStreams``): a job waits in its tenant's work stream
of the pool (``Keys.jobs(pool, tenant)``; the default tenant's is the pool's plain stream), listed
with the tenant's weight in ``Keys.tenants``, read by the pool's workers through one consumer group
on each (lease.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import redis.asyncio as aioredis
import structlog

from llamamesh.errors import QueueFull, QueueMisconfigured
from llamamesh.queue import affinity, codec
from llamamesh.queue.coalesce import ScriptPipe
from llamamesh.queue.groups import create_group
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, Keys, Retention, stream_tenant
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.scripts import register
from llamamesh.types import GenerationRequest

log = structlog.get_logger(__name__)


class WorkStreams:
    """A pool's work streams: jobs queued on them, the streams and groups made, remade or forgotten,
    the tenants and partitions they are named by. With prefix affinity on (``affinity_partitions`` P
    > 0; affinity.py, docs/affinity.md) each tenant's stream is P partition streams
    (``Keys.jobs_part``), a job's chosen by the hash of its prefix key (or, placement balanced, by
    where its key was first put: ``affinity.Placements``); the pool records P, and a
    gateway or worker configured otherwise is refused. A tenant whose streams hold nothing is
    forgotten (registry.py prunes), and its next submission makes them again."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retention: Retention,
        replicas: Replicas,
        partitions: int,
        placement: str = "hash",
        placement_ttl_s: float = 600.0,
    ) -> None:
        if partitions < 0:
            raise ValueError(f"affinity_partitions must be 0 (off) or more, not {partitions}")
        self._r = client
        self.keys = keys
        self.retention = retention
        self.replicas = replicas
        # Partitions per tenant's stream (0: affinity off).
        self.partitions = partitions
        # Affinity on: whether prefix keys are placed by their hash or balanced (affinity.Placements),
        # and how long a balanced placement outlives its key's last use.
        self.balanced = placement == "balanced"
        self.placement_ttl_ms = max(1, int(placement_ttl_s * 1000))
        self._submit = register(client, "submit")
        self._forget = register(client, "forget_tenant")
        self._remake = register(client, "remake_streams")
        self._check_partitions = register(client, "check_partitions")
        # Every request arriving together has its submission in one pipeline (coalesce.py), whose
        # WAIT covers them all.
        self._submissions = ScriptPipe(client, replicas)

    async def submit(self, pool: str, request: GenerationRequest, max_waiting: int = 0, weight: float = 1.0) -> None:
        """One script (submit.lua): the job on its tenant's stream (or its partition), unless a
        retry finds it queued already or the tenant's bound is reached (QueueFull). Raises
        QueueMisconfigured, QueueUnavailable."""
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be positive, not {weight!r}")
        tenant = stream_tenant(request.tenant)
        partition = affinity.partition_of(request, self.partitions) if self.partitions else None
        k = self.keys
        every = [k.owners(pool), k.placements(pool), k.placements_used(pool), k.placements_load(pool)]
        every = every + self.streams_of(pool, tenant) if self.partitions else []
        key = affinity.placement_field(tenant, request.prefix_key) if request.prefix_key else ""
        with unreachable():
            replies = await self._submissions.call(
                self._submit,
                keys=[
                    k.work(pool, tenant, partition),
                    k.submitted(pool, request.request_id),
                    k.tenants(pool),
                    k.partitions(pool),
                    *every,
                ],
                args=[
                    JOB_FIELD,
                    codec.encode_job(request),
                    max_waiting,
                    WORKER_GROUP,
                    self.retention.submitted_ttl_s,
                    tenant,
                    repr(float(weight)),
                    self.partitions,
                    "balanced" if self.balanced else "hash",
                    self.placement_ttl_ms,
                    key,
                    partition if partition is not None else 0,
                    affinity.FORGET_EACH,
                    affinity.MOST_PLACED,
                ],
            )
        waiting = int(replies[0])
        if waiting == -3:
            await self.misconfigured(pool)
        if waiting >= 0:
            whose = f"tenant {tenant!r} has" if tenant else "has"
            raise QueueFull(f"pool {pool!r} {whose} {waiting} requests waiting (at most {max_waiting}); retry later")
        self.replicas.check(replies, "the submission")

    async def queued(self, pool: str, request_id: str) -> bool:
        with unreachable():
            return bool(await self._r.exists(self.keys.submitted(pool, request_id)))

    async def join(self, pool: str) -> None:
        """The default tenant's streams and groups, and the pool's affinity partitions recorded (on),
        or checked to be none (off): QueueMisconfigured when they differ."""
        with unreachable():
            stored = int(await self._check_partitions(keys=[self.keys.partitions(pool)], args=[self.partitions]))
        if stored != self.partitions:
            await self.misconfigured(pool)
        for stream in self.streams_of(pool, ""):
            await create_group(self._r, stream)

    def streams_of(self, pool: str, tenant: str) -> list[str]:
        """Every work stream of a tenant of the pool: its partitions (affinity on), else its one."""
        if not self.partitions:
            return [self.keys.jobs(pool, tenant)]
        return [self.keys.jobs_part(pool, tenant, k) for k in range(self.partitions)]

    def where(self, tenants: Sequence[str]) -> list[tuple[str, int | None]]:
        """(tenant, partition or None) of every work stream of ``tenants``."""
        parts: Sequence[int | None] = range(self.partitions) if self.partitions else [None]
        return [(t, k) for t in tenants for k in parts]

    async def tenants(self, pool: str) -> dict[str, float]:
        """tenant -> weight from the pool's tenants hash (an unreadable weight: 1.0)."""
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.tenants(pool))
        weights = {}
        for t, w in raw.items():
            try:
                weights[t.decode()] = float(w)
            except ValueError:
                weights[t.decode()] = 1.0
        return weights

    async def remake(self, pool: str, lost: set[str]) -> None:
        """Streams that were not there when read: make again those of tenants still listed (a
        forgotten tenant's stay gone), saying so loudly for the default stream (Redis came back
        without its data: the gateways' readiness goes NOT_SERVING on the same loss)."""
        for tenant in sorted(lost):
            with unreachable("cannot create the consumer group"):
                made = int(
                    await self._remake(
                        keys=[self.keys.tenants(pool), *self.streams_of(pool, tenant)], args=[tenant, WORKER_GROUP]
                    )
                )
            if made and not tenant:
                log.error("consumer_group_missing", pool=pool, detail="Redis lost the work stream; recreating it")

    async def forget_idle(self, pool: str, tenants: Sequence[str]) -> list[str]:
        """Forget those of ``tenants`` (never the default one) whose streams hold nothing, with their
        streams (forget_tenant.lua); returns them. Raises QueueUnavailable."""
        forgotten = []
        with unreachable():
            for t in tenants:
                if t and int(
                    await self._forget(
                        keys=[self.keys.tenants(pool), *self.streams_of(pool, t)], args=[t, WORKER_GROUP]
                    )
                ):
                    forgotten.append(t)
        return forgotten

    async def misconfigured(self, pool: str) -> NoReturn:
        """Raise QueueMisconfigured: the pool's recorded partitions are not this process's."""
        with unreachable():
            raw: Any = await self._r.get(self.keys.partitions(pool))
        stored = raw.decode() if raw else "0"
        log.error("affinity_mismatch", pool=pool, recorded=stored, configured=self.partitions)
        raise QueueMisconfigured(
            f"pool {pool!r} is split into {stored} affinity partitions, this process into {self.partitions} "
            "(LLAMAMESH_REDIS_AFFINITY_PARTITIONS must be the same on the pool's gateways and workers)"
        )

    async def close(self) -> None:
        await self._submissions.close()
