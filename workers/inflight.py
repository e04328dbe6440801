"""The jobs a worker runs: one task each, started from its lease, tracked until it ends, and on the
way out drained (grace, then aborted and handed back) or, with a wedged engine, abandoned."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any

import structlog

from llamamesh.errors import EngineDead
from llamamesh.queue.protocol import BatchStore, Lease
from workers.allowance import BatchAllowance
from workers.batch import run_batch_item
from workers.carry_on import Carried
from workers.job import Job
from workers.life import Life
from workers.outbox import Outbox
from workers.samples import Samples
from workers.wakeups import first

log = structlog.get_logger(__name__)


class Inflight:
    """Owns the job tasks: cancels and awaits them on the way out. A job whose engine died records the
    death in ``life`` (the worker then stops)."""

    def __init__(
        self,
        samples: Samples,
        outbox: Outbox,
        batches: BatchStore | None,
        worker: str,
        life: Life,
        allowance: BatchAllowance | None = None,
    ) -> None:
        """``allowance``: told each interactive request's time to first token and each batch item's
        length (adaptive batch admission)."""
        self._samples = samples
        self._allowance = allowance
        self._outbox = outbox
        self._batches = batches
        self._worker = worker
        self._life = life
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # Interactive jobs and batch items running here (request id -> lease): touched every heartbeat
        # so that nobody takes them over while this worker lives.
        self.running: dict[str, Lease] = {}
        self.batch_running: dict[str, Lease] = {}
        self._batch_started: dict[str, float] = {}  # request id -> when its item started (monotonic)
        # Set when the drain's grace ran out: the jobs it aborts end worker_lost (handed back).
        self.handing_back = asyncio.Event()

    def __len__(self) -> int:
        return len(self.tasks)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tasks

    def start(self, lease: Lease, carried: Carried | None = None) -> None:
        """Run the leased job (a batch item when batches are on and it is one) in a task of its own;
        ``carried``: a job a dead worker had begun, going on from its stream's tokens."""
        rid = lease.request.request_id
        if lease.request.batch_id and self._batches is not None:
            job: Coroutine[Any, Any, None] = run_batch_item(lease, self._samples, self._batches)
            self.batch_running[rid] = lease
            self._batch_started[rid] = time.monotonic()
        else:
            seen = self._allowance.first_token if self._allowance is not None else None
            job = Job(lease, self._samples, self._outbox, self._worker, self.handing_back, seen, carried).run()
            self.running[rid] = lease
        task = asyncio.create_task(job, name=f"job-{rid}")
        self.tasks[rid] = task
        task.add_done_callback(lambda t, rid=rid: self._done(rid, t))  # type: ignore[misc]

    def _done(self, rid: str, task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)
        self._outbox.release(rid)
        started = self._batch_started.pop(rid, None)
        if started is not None and self._allowance is not None:
            self._allowance.item_done(time.monotonic() - started)
        self.batch_running.pop(rid, None)
        self.running.pop(rid, None)
        self._life.slot_free.set()
        if not task.cancelled() and isinstance(task.exception(), EngineDead):
            self._life.engine_died = task.exception()  # type: ignore[assignment]

    async def forsake(self, rids: list[str]) -> None:
        """Stop these jobs, writing nothing more: another worker took them over (it runs them now),
        or Redis came back without their data (their records, streams and leases are gone, and a
        request sent again under the same id runs as a new job, whose stream theirs must not mix
        into)."""
        self._outbox.forsake(rids)
        tasks = [self.tasks[rid] for rid in rids if rid in self.tasks]
        for rid in rids:
            await self._samples.abort(rid)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    async def drain(self, grace_s: float) -> None:
        """Give the jobs ``grace_s`` to finish, abort the rest (they end worker_lost: handed back), then
        flush the outbox. If the event writer fails meanwhile, return at once with the jobs as they
        are (the worker is wedged then: nothing they do can be published; the worker abandons them)."""
        if self.tasks:
            log.info("worker_draining", inflight=len(self.tasks), grace_s=grace_s)
            tasks = list(self.tasks.values())
            await first(asyncio.wait(tasks), self._life.writer_failed.wait(), timeout=grace_s)
            if self._life.wedged:
                dead = self._life.engine_died
                log.error("worker_drain_cut", reason=dead.message if dead else "wedged")
                return
            pending = {t for t in tasks if not t.done()}
            self.handing_back.set()
            for rid in list(self.tasks):
                await self._samples.abort(rid)
            if pending:
                _done, still = await asyncio.wait(pending, timeout=5)
                for t in still:
                    t.cancel()
                await asyncio.gather(*still, return_exceptions=True)
        await self._outbox.close()

    async def abandon(self) -> None:
        """A wedged engine: cancel every job task without waiting on the engine (each still writes its
        terminal event, worker_lost, so gateways resume it elsewhere)."""
        self.handing_back.set()
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._outbox.close(), 5)
