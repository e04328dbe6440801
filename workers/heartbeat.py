"""A worker's heartbeat: every ``heartbeat_s`` its status (state, load, engine figures, adapters) in
Redis with the short TTL, the jobs it runs touched so that nobody takes them over, its gauges
updated, and the run-time adapters synced beside it."""

from __future__ import annotations

import asyncio
import time

import structlog

from llamamesh import metrics
from llamamesh.errors import QueueUnavailable
from llamamesh.queue.protocol import BatchStore, WorkQueue
from llamamesh.settings import WorkerSettings
from llamamesh.types import WorkerState, WorkerStatus
from workers.engines.base import Engine
from workers.inflight import Inflight
from workers.life import Life
from workers.lora import LoraAdapters
from workers.wakeups import any_set

log = structlog.get_logger(__name__)


class Heartbeat:
    def __init__(
        self,
        settings: WorkerSettings,
        queue: WorkQueue,
        batches: BatchStore | None,
        engine: Engine,
        life: Life,
        jobs: Inflight,
        adapters: LoraAdapters,
    ) -> None:
        self._s = settings
        self._queue = queue
        self._batches = batches
        self._engine = engine
        self._life = life
        self._jobs = jobs
        self._adapters = adapters
        self._name = settings.consumer_name()
        self._steps_counted = 0  # of the engine's step counter, added to llamamesh_engine_steps_total
        self._epoch = ""  # the queue's data's, as the last beat saw it

    def status(self) -> WorkerStatus:
        """What the heartbeat says now (while starting: what the engine's start is doing); updates the
        worker's gauges and the engine step counter."""
        life, pool = self._life, self._s.pool
        stats = self._engine.stats()
        if life.state is WorkerState.STARTING:
            doing = self._engine.starting or "starting the engine"
            if doing != life.detail:
                life.detail, life.since = doing, time.time()
        metrics.WORKER_INFLIGHT.labels(pool).set(len(self._jobs))
        metrics.ENGINE_RUNNING.labels(pool).set(stats.running)
        metrics.ENGINE_WAITING.labels(pool).set(stats.waiting)
        metrics.KV_CACHE_USAGE.labels(pool).set(stats.kv_cache_usage)
        if stats.steps > self._steps_counted:  # -1: the engine does not count
            metrics.ENGINE_STEPS.labels(pool).inc(stats.steps - self._steps_counted)
            self._steps_counted = stats.steps
        loaded, errors = self._adapters.loaded, self._adapters.errors
        return WorkerStatus(
            worker=self._name,
            pool=pool,
            model=self._s.model,
            engine=self._s.engine,
            inflight=len(self._jobs),
            max_inflight=self._s.max_inflight,
            running=stats.running,
            waiting=stats.waiting,
            kv_cache_usage=stats.kv_cache_usage,
            state=life.state.value,
            detail=life.detail,
            since_unix_s=life.since,
            adapters=tuple(getattr(self._engine, "adapters", ())),
            adapter_errors=tuple(f"{name}={path}: {why}" for (name, path), why in errors.items()),
            adapter_paths=tuple(f"{name}={path}" for name, path in sorted(loaded.items())),
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Owned by the worker: say it is alive (starting, then ready) until ``stop`` (set once it has
        drained) or its engine's death; owns the adapter sync task, started beside each beat."""
        sync: asyncio.Task[None] | None = None
        try:
            while not stop.is_set() and self._life.engine_died is None:
                if sync is None or sync.done():
                    # Beside the heartbeat, never in its way: loading an adapter can take seconds.
                    sync = asyncio.create_task(self._adapters.sync_quietly(), name="adapter-sync")
                await self._beat()
                await any_set(stop, timeout=self._s.heartbeat_s)
        finally:
            if sync is not None:
                sync.cancel()
                await asyncio.gather(sync, return_exceptions=True)

    async def _beat(self) -> None:
        running = {x.ref: rid for rid, x in self._jobs.running.items()}
        items = {x.item_ref: rid for rid, x in self._jobs.batch_running.items()}  # (refs of other streams)
        ttl = self._s.heartbeat_ttl_s
        try:
            lost = [running[ref] for ref in await self._queue.heartbeat(self.status(), ttl, touch=list(running))]
            if self._batches is not None and items:
                lost += [items[ref] for ref in await self._batches.touch(self._s.pool, self._name, list(items))]
            epoch = await self._queue.epoch()
        except QueueUnavailable:
            self._life.unreachable()
            log.warning("heartbeat_failed")
            return
        if lost:
            await self._taken_over(lost)
        if self._epoch and epoch != self._epoch and not await self._data_lost():
            return  # (looked at again next beat)
        self._epoch = epoch

    async def _taken_over(self, rids: list[str]) -> None:
        """Jobs another worker took over while this one could not touch them (it was paused, or cut
        off from Redis, for the claim idle time): that worker runs them now, from what their streams
        hold, so these stop here, writing nothing more."""
        await self._jobs.forsake(rids)
        log.warning("jobs_taken_over", count=len(rids), request_ids=rids)

    async def _data_lost(self) -> bool:
        """Redis came back without its data: stop the jobs running here that were not queued to what
        it holds now (those queued since it came back run on; batch items' results land in no batch)."""
        running = list(self._jobs.running.items())
        try:
            lost = [rid for rid, lease in running if not await self._queue.queued(lease.pool, rid)]
        except QueueUnavailable:
            log.warning("heartbeat_failed")
            return False
        await self._jobs.forsake(lost)
        log.error("redis_data_lost", jobs_stopped=len(lost), detail="Redis answers without the queue's data")
        return True
