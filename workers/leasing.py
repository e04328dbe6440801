"""How a worker takes work: by free slots (``max_inflight`` minus the jobs in flight), interactive
jobs first, batch items within their share, the tenant headroom kept for tenants with nothing running
here, and jobs of workers that died reclaimed; then each lease admitted (started, skipped or ended)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import structlog

from llamamesh import metrics
from llamamesh.backoff import Delays
from llamamesh.errors import QueueUnavailable, WorkerDied
from llamamesh.queue.protocol import BatchStore, Lease, WorkQueue
from llamamesh.settings import BatchSettings, WorkerSettings
from llamamesh.types import JobEvent
from workers.allowance import BatchAllowance
from workers.batch import record, skipped_result
from workers.carry_on import carried
from workers.inflight import Inflight
from workers.job import cancelled_event, failure_of
from workers.life import Life
from workers.outbox import Outbox
from workers.wakeups import any_set

log = structlog.get_logger(__name__)


class Leasing:
    """The worker's lease loop and what it admits."""

    def __init__(
        self,
        settings: WorkerSettings,
        queue: WorkQueue,
        batches: BatchStore | None,
        batch: BatchSettings,
        allowance: BatchAllowance,
        block_ms: int,
        jobs: Inflight,
        outbox: Outbox,
        life: Life,
    ) -> None:
        self._s = settings
        self._queue = queue
        self._batches = batches
        self._b = batch
        self._allowance = allowance
        self._block_ms = block_ms
        self._jobs = jobs
        self._outbox = outbox
        self._life = life
        self._name = settings.consumer_name()
        # When it last reclaimed (monotonic), batch items and jobs. Neither is reclaimed within half
        # the claim idle time of the last time Redis did not answer it (``Life.unreachable_at``): a
        # live worker's jobs look idle after an outage until its next heartbeat touches them, and a
        # worker whose slots were full saw the outage only in its heartbeat.
        self._last_reclaim = 0.0
        self._last_job_reclaim = time.monotonic()
        # Only the tenant headroom was free at the last lease (see _interactive).
        self._polling = False

    async def run(self, stop: asyncio.Event) -> None:
        """Lease by free slots until ``stop`` or the engine's death."""
        delays = Delays(first_s=0.1)
        slot_free = self._life.slot_free
        while not stop.is_set() and self._life.engine_died is None:
            free = self._s.max_inflight - len(self._jobs)
            slot_free.clear()
            if free <= 0:
                await any_set(slot_free, stop)
                continue
            try:
                leases = await self._lease(free)
                delays.reset()
            except QueueUnavailable as exc:
                self._life.unreachable()
                log.warning("lease_failed", error=exc.detail, retry_in_s=round(await delays.wait(stop), 3))
                continue
            if self._life.engine_died is not None and leases:
                await self._hand_back(leases)  # its engine died while it was waiting for them
                break
            for lease in leases:
                await self.admit(lease)
            if not leases and self._polling:  # only the headroom is free: look again soon
                await any_set(slot_free, stop, timeout=self._s.headroom_poll_s)

    async def reclaim_own(self) -> None:
        """This consumer's own leased jobs (a restart under the same name), admitted first."""
        s = self._s
        with contextlib.suppress(QueueUnavailable):
            for lease in await self._queue.reclaim(s.pool, self._name, 0, s.max_inflight, s.max_deliveries, own=True):
                await self.admit(lease)

    async def _hand_back(self, leases: list[Lease]) -> None:
        """Jobs leased after the engine died, never started: each is handed back (not a death:
        nothing ran), so a gateway following it sends it to another worker at once, and otherwise
        the worker that claims it runs it. A batch item is left leased without a word: another
        worker reclaims it once idle (claim_idle_s)."""
        for lease in leases:
            if not lease.request.batch_id:
                await self._outbox.finish(lease, JobEvent(worker=self._name, handed_back=True))
        log.warning("jobs_handed_back", count=len(leases), reason="engine_died")

    async def admit(self, lease: Lease) -> None:
        """Start a leased job, or end it here: cancelled before it ran, begun by a worker that died
        (its caller has tokens), or a batch item that is skipped or already running."""
        rid = lease.request.request_id
        if lease.request.batch_id and self._batches is not None:
            await self._admit_item(lease, self._batches)
        elif lease.cancelled:
            await self._outbox.finish(lease, cancelled_event(lease, self._name))
            log.info("job_skipped_cancelled", request_id=rid)
        elif lease.started:
            await self._carry_on(lease)
        else:
            self._jobs.start(lease)

    async def _carry_on(self, lease: Lease) -> None:
        """A job a dead worker had begun: its caller may have those tokens, so a run from the start
        would send them again. It goes on in place from what its stream holds (workers/carry_on.py);
        when that cannot be, it ends worker_died and a gateway following it resumes it elsewhere."""
        rid = lease.request.request_id
        c = carried(lease.request, lease.begun, self._name)
        if c is None:
            died = WorkerDied("the worker running it died")
            await self._outbox.finish(lease, JobEvent(worker=self._name, failed=failure_of(died)))
            log.info("job_not_restarted", request_id=rid)
            return
        for ev in c.ends:
            self._outbox.add(lease, ev)
        tokens = c.generated
        if c.done is not None:
            await self._outbox.finish(lease, c.done)
            log.info("job_carried_on", request_id=rid, tokens=tokens, left=0)
            return
        log.info("job_carried_on", request_id=rid, tokens=tokens, left=c.request.sampling.max_tokens)
        self._jobs.start(dataclasses.replace(lease, request=c.request), c)

    async def _admit_item(self, lease: Lease, batches: BatchStore) -> None:
        rid = lease.request.request_id
        if lease.cancelled or lease.expired:
            await record(batches, lease, skipped_result(lease))
        elif rid in self._jobs:
            running = self._jobs.batch_running.get(rid)
            if running is not None and running.item_ref == lease.item_ref:
                # Its own entry, claimed back (its touches missed while Redis was out): it runs
                # here already, and stays leased until it records its result.
                return
            # The same item queued twice (a resubmitted batch): run it once. Not dropped now (Redis
            # out): it stays leased and comes back later, as a duplicate then or to run if the first
            # copy ended without a result.
            with contextlib.suppress(QueueUnavailable):
                await batches.discard(lease)
        else:
            self._jobs.start(lease)

    async def _lease(self, free: int) -> list[Lease]:
        """Up to ``free`` jobs: interactive ones first; batch items fill what is left up to the
        batch allowance (``max_share`` of the slots, or less while adaptive admission sees
        interactive requests suffer), and get ``min_share`` even while interactive work queues;
        new batch items start at the allowance's pace.

        With batches on, the blocking read of the interactive stream waits at most 100 ms, so that
        batch items (on another stream) are picked up as slots free; about ten reads a second idle."""
        taken = await self._reclaim_jobs(free)
        free -= len(taken)
        if free <= 0:
            return taken
        if self._batches is None:
            return [*taken, *await self._interactive(free, self._block_ms)]
        allowance = self._allowance
        cap = allowance.slots(len(self._jobs.batch_running))
        batch = await self._reclaim_items(self._batches, free, cap)
        reserve = min(free - len(batch), allowance.floor - len(self._jobs.batch_running) - len(batch))
        if reserve > 0:
            batch += await self._new_items(self._batches, reserve)
        free -= len(batch)
        inter = await self._interactive(free, min(self._block_ms, 100)) if free > 0 else []
        free -= len(inter)
        room = min(free, cap - len(self._jobs.batch_running) - len(batch), max(1, self._s.lease_batch))
        if room > 0:
            batch += await self._new_items(self._batches, room)
        return [*taken, *inter, *batch]

    async def _new_items(self, batches: BatchStore, wanted: int) -> list[Lease]:
        """Up to ``wanted`` new batch items, as many as the allowance's pace lets start now. Not
        blocking: an idle Redis ends a short BLOCK only at its next tick (100 ms)."""
        count = self._allowance.startable(wanted)
        if count <= 0:
            return []
        items = await batches.lease_items(self._s.pool, self._name, count, None)
        self._allowance.started(len(items))
        return items

    async def _reclaim_items(self, batches: BatchStore, free: int, cap: int) -> list[Lease]:
        """Every claim_idle_s / 2: batch items of workers that died, within the batch share."""
        now = time.monotonic()
        if now - max(self._last_reclaim, self._life.unreachable_at) < self._b.claim_idle_s / 2:
            return []
        self._last_reclaim = now
        room = min(free, cap - len(self._jobs.batch_running))
        if room <= 0:
            return []
        return await batches.reclaim(self._s.pool, self._name, int(self._b.claim_idle_s * 1000), room)

    async def _interactive(self, free: int, block_ms: int) -> list[Lease]:
        """Up to ``free`` interactive jobs, keeping ``tenant_headroom`` slots for tenants with
        nothing running here: when only those are left, a non-blocking look at the other tenants'
        streams (``_polling``: the lease loop looks again every ``headroom_poll_s``)."""
        pool, name, step = self._s.pool, self._name, max(1, self._s.lease_batch)
        busy = {x.tenant for x in self._jobs.running.values()}
        headroom = min(self._s.tenant_headroom, self._s.max_inflight - 1)
        self._polling = 0 < free <= headroom
        if self._polling:
            leases = await self._queue.lease(pool, name, min(free, step), 0, exclude=busy)
        else:
            leases = await self._queue.lease(pool, name, min(free - headroom, step), block_ms)
        for x in leases:  # prefix affinity on: from its own partitions, or stolen from another's
            if x.partition is not None:
                metrics.AFFINITY_LEASES.labels(pool, "stolen" if x.stolen else "own").inc()
        return leases

    async def _reclaim_jobs(self, free: int) -> list[Lease]:
        """Every claim_idle_s / 2: jobs untouched for claim_idle_s (of workers that died, or its own
        that it does not run: leased but never started here, or acked in a Redis that lost it)."""
        now = time.monotonic()
        if now - max(self._last_job_reclaim, self._life.unreachable_at) < self._s.claim_idle_s / 2:
            return []
        self._last_job_reclaim = now
        s = self._s
        running = {x.ref for x in self._jobs.running.values()}  # entries of every tenant's stream
        return await self._queue.reclaim(
            s.pool, self._name, int(s.claim_idle_s * 1000), free, s.max_deliveries, running=running
        )
