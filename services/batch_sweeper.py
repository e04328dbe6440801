"""The batch sweeper: every gateway's background end of what batches can no longer run."""

from __future__ import annotations

import asyncio
import time

import structlog

from llamamesh import metrics
from llamamesh.errors import QueueUnavailable
from llamamesh.loop import cancel_and_wait
from llamamesh.queue.gateway_stores import Quotas
from llamamesh.queue.keys import UNSTORED_GRACE_S
from llamamesh.queue.protocol import BatchStore
from llamamesh.types import BatchInfo
from llamamesh.types.batches import batch_at_risk, projected_finish

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
        self._late: set[str] = set()  # batches projected late at the last sweep

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-sweeper")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            try:
                await self._store.sweep()
                self._watch(await self._store.open_batches(), time.time())
                if self._quotas is not None:  # what ended batches held of their tenants' budgets
                    await self._quotas.give_back(self._grace_s)
            except QueueUnavailable as exc:
                log.warning("batch_sweep_failed", error=exc.detail, retry_in_s=self._interval_s)
            except Exception:  # a sweep must never kill the gateway
                log.exception("batch_sweep_crashed")
            await asyncio.sleep(self._interval_s)

    def _watch(self, infos: list[BatchInfo], now: float) -> None:
        """The open batches' gauges: at risk, projected late and the worst projection; a batch newly
        projected late is logged once (batch_projected_late) with its figures."""
        late: set[str] = set()
        worst = 0.0
        for info in infos:
            end = projected_finish(info, now)
            if end is None:
                continue
            ratio = (end - info.created_at) / max(info.expires_at - info.created_at, 1e-3)
            worst = max(worst, ratio)
            if end > info.expires_at:
                late.add(info.batch_id)
                if info.batch_id not in self._late:
                    log.warning(
                        "batch_projected_late",
                        batch_id=info.batch_id,
                        left=info.processing,
                        projected_finish_s=round(end - now, 1),
                        window_left_s=round(info.expires_at - now, 1),
                    )
        self._late = late
        metrics.BATCHES_AT_RISK.set(sum(batch_at_risk(i, now, metrics.AT_RISK_FRACTION) for i in infos))
        metrics.BATCHES_PROJECTED_LATE.set(len(late))
        metrics.BATCH_PROJECTED_FINISH.set(worst)
