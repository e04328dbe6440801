"""The batch sweeper: every gateway's background end of what batches can no longer run."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from llamamesh import metrics
from llamamesh.errors import QueueUnavailable
from llamamesh.queue.keys import UNSTORED_GRACE_S
from llamamesh.queue.protocol import BatchStore, Quotas

log = structlog.get_logger(__name__)


class BatchSweeper:
    """Ends, every ``interval_s``, whether or not a worker runs, what can no longer run: the unstarted
    items of batches past their deadline, and the items a dead worker left leased in those and in
    cancelled or failed batches (workers expire the items they lease late too); and gives back
    what ended and purged batches held of their tenants' budgets. Every gateway runs
    one: a sweep is safe to repeat and to race."""

    def __init__(
        self, store: BatchStore, interval_s: float, quotas: Quotas | None = None, retention_s: float = UNSTORED_GRACE_S
    ) -> None:
        self._store = store
        self._quotas = quotas
        # A batch hold with no record is a purged batch once older than this (or one being stored).
        self._grace_s = min(UNSTORED_GRACE_S, retention_s)
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self._store.sweep()
                metrics.BATCHES_AT_RISK.set(await self._store.at_risk(metrics.AT_RISK_FRACTION))
                if self._quotas is not None:  # what ended batches held of their tenants' budgets
                    await self._quotas.give_back(self._grace_s)
            except QueueUnavailable:
                log.warning("batch_sweep_failed", retry_in_s=self._interval_s)
            except Exception:  # a sweep must never kill the gateway
                log.exception("batch_sweep_crashed")
            await asyncio.sleep(self._interval_s)
