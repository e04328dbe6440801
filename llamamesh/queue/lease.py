"""Leasing: a worker takes new jobs from its pool's work streams.

A lease shares the workers between the tenants with jobs waiting by deficit round robin
(``fair.FairShare``): rounds of non-blocking reads, one pipeline each, and only when nothing waits
one blocking read of every stream. With prefix affinity on (affinity.py) the streams are the
partitions this worker owns (its last heartbeat says which, registry.py), then a steal from the
others' when it has nothing of its own; off, every tenant's stream is one partition, all its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import codec, groups
from llamamesh.queue.cancels import CancelFlags
from llamamesh.queue.fair import FairShare
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, Keys
from llamamesh.queue.protocol import Lease, entry_order
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.queue.scripts import register
from llamamesh.queue.submit import WorkStreams

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

# A worker reads its pool's tenants (``keys.tenants``) at most this often while it finds work, and
# again before each blocking read: a new tenant is seen within this, or within one block.
TENANTS_REFRESH_S = 0.5


class Taken(NamedTuple):
    """An entry leased from a work stream, before its job is decoded."""

    tenant: str
    partition: int | None  # None: affinity off (the tenant's one stream)
    entry_id: str
    fields: Any  # the entry's fields as Redis returned them
    stolen: bool = False


class Leasing:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        work: WorkStreams,
        flags: CancelFlags,
        owned: Callable[[str, str], list[int]],
        clock: Callable[[], float],
        steal_after_ms: int,
    ) -> None:
        self._r = client
        self.keys = keys
        self._work = work
        self._flags = flags
        self._owned = owned
        self._clock = clock
        self._steal_after_ms = max(1, steal_after_ms)
        # pool -> the fair share of its tenants (deficit round robin), for this process's leases
        self._fair: dict[str, FairShare] = {}
        self._take = register(client, "take_oldest")
        self._give_back = register(client, "give_back_job")

    async def lease(
        self, pool: str, consumer: str, count: int, block_ms: int, exclude: Collection[str] = ()
    ) -> list[Lease]:
        """``_look`` until ``count`` jobs are leased or every stream came up short; only when
        nothing was leased and ``block_ms`` > 0, a blocking read. Affinity off: one, of every
        tenant's stream for ``block_ms``. On: of its own partitions for at most
        ``affinity_steal_after_ms`` (owning none: a wait as long), then a look again, until
        ``block_ms`` is over: a busy owner's queued job is stolen by an idle worker within about
        twice ``affinity_steal_after_ms``. Never more than ``count`` jobs. A stream or group Redis
        lost is made again. Raises QueueUnavailable."""
        if count <= 0:
            return []
        fair = await self.fair_share(pool)
        deadline = self._clock() + block_ms / 1000
        while True:
            owned = self._owned(pool, consumer) if self._work.partitions else [None]
            others = [k for k in range(self._work.partitions) if k not in owned]
            got = await self._look(pool, consumer, count, fair, exclude, owned, others)
            if got or block_ms <= 0:
                break
            if not self._work.partitions:
                got = await self._block(pool, consumer, count, block_ms, fair, exclude, owned)
                break
            left_ms = int((deadline - self._clock()) * 1000)
            if left_ms <= 0:
                break
            wait = min(left_ms, self._steal_after_ms)
            if owned:
                got = await self._block(pool, consumer, count, wait, fair, exclude, owned)
            else:  # nothing of its own to wait on: look at the others' again after as long
                await asyncio.sleep(wait / 1000)
            if got:
                break
        return await self._decoded(pool, got)

    async def fair_share(self, pool: str) -> FairShare:
        """The pool's fair share, its tenants read again if older than ``TENANTS_REFRESH_S``."""
        fair = self._fair.setdefault(pool, FairShare())
        if fair.read_at is None or self._clock() - fair.read_at >= TENANTS_REFRESH_S:
            await self._refresh(pool, fair)
        return fair

    async def _refresh(self, pool: str, fair: FairShare) -> None:
        fair.set_tenants(await self._work.tenants(pool), self._clock())

    async def _look(
        self,
        pool: str,
        consumer: str,
        count: int,
        fair: FairShare,
        exclude: Collection[str],
        owned: Sequence[int | None],
        others: Sequence[int],
    ) -> list[Taken]:
        """Without blocking: the rounds over the tenants' ``owned`` partitions; only if they gave
        nothing, over those of tenants that came meanwhile (read again first); only if that gave
        nothing either, over the ``others`` (a steal: the oldest jobs that waited
        ``affinity_steal_after_ms`` or more there, so an owner with room gets its own first)."""
        got: list[Taken] = []
        if owned:
            got = await self._rounds(pool, consumer, count, fair, set(fair.tenants) - set(exclude), owned)
        if not got:
            before = set(fair.tenants)
            await self._refresh(pool, fair)
            if owned and (fresh := set(fair.tenants) - before - set(exclude)):
                got = await self._rounds(pool, consumer, count, fair, fresh, owned)
        if not got and others:
            got = await self._rounds(pool, consumer, count, fair, set(fair.tenants) - set(exclude), others, stolen=True)
        return got

    async def _rounds(
        self,
        pool: str,
        consumer: str,
        count: int,
        fair: FairShare,
        candidates: set[str],
        partitions: Sequence[int | None],
        stolen: bool = False,
    ) -> list[Taken]:
        """Non-blocking leases by the fair share's plan until ``count`` or no candidate is left: a
        tenant's share is read from its stream (affinity off), or is the oldest jobs among its
        ``partitions`` (take_oldest.lua, one script a tenant). Streams found missing are made again."""
        got: list[Taken] = []
        lost: set[str] = set()
        while len(got) < count and candidates:
            asks = fair.plan(count - len(got), candidates)
            if self._work.partitions:
                reads = await self._take_oldest(pool, consumer, asks, partitions, stolen)
            else:
                reads = await self._read(pool, consumer, asks)
            for (tenant, n), (entries, missing) in zip(asks.items(), reads, strict=True):
                if missing:
                    lost.add(tenant)
                got += _served(fair, tenant, n, entries, candidates)
        if lost:
            await self._recover(pool, fair, lost)
        return got

    async def _read(self, pool: str, consumer: str, asks: dict[str, int]) -> list[tuple[list[Taken], bool]]:
        """Each tenant's asked share of its stream, in one pipeline: (entries, whether it is missing)."""
        with unreachable("cannot read the work stream"):
            async with self._r.pipeline(transaction=False) as pipe:
                for tenant, n in asks.items():
                    pipe.xreadgroup(WORKER_GROUP, consumer, {self.keys.jobs(pool, tenant): ">"}, count=n)
                replies = await pipe.execute(raise_on_error=False)
        out: list[tuple[list[Taken], bool]] = []
        for tenant, reply in zip(asks, replies, strict=True):
            if isinstance(reply, BaseException):
                if not groups.gone(reply):
                    raise QueueUnavailable(f"cannot read the work stream: {reply}") from reply
                out.append(([], True))
                continue
            out.append(([Taken(tenant, None, e.decode(), f) for _s, es in reply or () for e, f in es], False))
        return out

    async def _take_oldest(
        self, pool: str, consumer: str, asks: dict[str, int], partitions: Sequence[int | None], stolen: bool
    ) -> list[tuple[list[Taken], bool]]:
        """Each tenant's asked share as the oldest jobs among its ``partitions``, one script each;
        ``stolen`` (others' partitions): only jobs that waited ``affinity_steal_after_ms``."""
        age = self._steal_after_ms if stolen else 0
        with unreachable("cannot read the work stream"):
            replies = await call_scripts(
                self._r,
                [
                    (
                        self._take,
                        [self.keys.work(pool, tenant, k) for k in partitions],
                        [WORKER_GROUP, consumer, n, age],
                    )
                    for tenant, n in asks.items()
                ],
            )
        out: list[tuple[list[Taken], bool]] = []
        for tenant, reply in zip(asks, replies, strict=True):
            if isinstance(reply, BaseException):
                raise QueueUnavailable(f"cannot read the work stream: {reply}") from reply
            taken, missing = reply
            entries = [
                Taken(tenant, partitions[int(i) - 1], eid.decode(), dict(zip(f[::2], f[1::2], strict=True)), stolen)
                for i, eid, f in taken
            ]
            entries.sort(key=lambda e: entry_order(e.entry_id))  # oldest first (ids of one ms: any order)
            out.append((entries, bool(missing)))
        return out

    async def _block(
        self,
        pool: str,
        consumer: str,
        count: int,
        block_ms: int,
        fair: FairShare,
        exclude: Collection[str],
        partitions: Sequence[int | None],
    ) -> list[Taken]:
        """One blocking read of the ``partitions`` of every tenant's stream (but ``exclude``'s), a
        few jobs of each (``count`` shared out); a race that fills several streams at once may
        return more than ``count``: those go back (give_back_job.lua)."""
        streams = {self.keys.work(pool, t, k): (t, k) for t in fair.tenants if t not in exclude for k in partitions}
        if not streams:
            return []
        each = max(1, count // len(streams))
        with unreachable("cannot read the work stream"):
            try:
                reply: Any = await self._r.xreadgroup(
                    WORKER_GROUP, consumer, dict.fromkeys(streams, ">"), count=each, block=block_ms
                )
            except ResponseError as exc:
                if not groups.gone(exc):
                    raise
                await self._recover(pool, fair, set(fair.tenants))
                return []
        got = [Taken(*streams[s.decode()], e.decode(), f) for s, es in reply or () for e, f in es]
        if len(got) > count:
            with unreachable():
                for t in got[count:]:
                    await self._give_back(
                        keys=[self.keys.work(pool, t.tenant, t.partition)], args=[WORKER_GROUP, t.entry_id]
                    )
            got = got[:count]
        return got

    async def _recover(self, pool: str, fair: FairShare, lost: set[str]) -> None:
        """Make again the streams of ``lost`` tenants still listed, then read the tenants again."""
        await self._work.remake(pool, lost)
        await self._refresh(pool, fair)

    async def _decoded(self, pool: str, got: list[Taken]) -> list[Lease]:
        """Leases of the entries taken, with their cancel flags; an entry that is no job is logged
        and dropped."""
        leased: list[Lease] = []
        bad: dict[tuple[str, int | None], list[str]] = {}
        for t in got:
            try:
                request = codec.decode_job(t.fields[JOB_FIELD.encode()])
            except (InvalidRequest, KeyError):
                log.error("job_undecodable", pool=pool, tenant=t.tenant, entry_id=t.entry_id)
                bad.setdefault((t.tenant, t.partition), []).append(t.entry_id)
                continue
            leased.append(
                Lease(
                    pool=pool,
                    entry_id=t.entry_id,
                    request=request,
                    tenant=t.tenant,
                    partition=t.partition,
                    stolen=t.stolen,
                )
            )
        for (tenant, k), eids in bad.items():
            await groups.drop(self._r, self.keys.work(pool, tenant, k), eids)
        return await self._flags.flagged(leased)


def _served(fair: FairShare, tenant: str, asked: int, entries: list[_T], candidates: set[str]) -> list[_T]:
    """A round's read of one tenant: the fair share learns what it gave; a tenant that gave fewer
    than asked is empty and leaves the round's candidates. Returns ``entries``."""
    fair.served(tenant, asked, len(entries))
    if len(entries) < asked:
        candidates.discard(tenant)
    return entries
