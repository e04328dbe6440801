"""One worker process (ProcessMode.ONE_PROCESS, and each frontend or replica): signals, the engine
built from the settings (announced before its import), one Worker (workers/worker.py) over the Redis
queue, its health endpoint, and a bounded shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time

import structlog

from llamamesh import metrics
from llamamesh.errors import EngineDead, InvalidRequest, QueueRefused, QueueUnavailable
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import Settings, prometheus_multiproc_dir
from llamamesh.types import WorkerState, WorkerStatus
from workers.engines import registry
from workers.engines.base import Engine
from workers.health import HealthServer
from workers.worker import FAILED_TTL_S, Worker

log = structlog.get_logger(__name__)


async def serve(settings: Settings, engine: Engine | None = None) -> int:
    """Run one worker process until SIGTERM/SIGINT; returns the exit code (1: the engine could not
    start, died or wedged). ``engine``: the registry's engine for ``settings.worker.engine`` when not
    given (imported here, after the first heartbeat said the worker is starting)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ws = settings.worker
    structlog.contextvars.bind_contextvars(worker=ws.consumer_name(), pool=ws.pool)
    metrics.serve(ws.metrics_port, ws.metrics_host, "worker", prometheus_multiproc_dir())
    queue = RedisQueue.from_settings(settings.redis)
    code = 0
    worker: Worker | None = None

    def probe() -> tuple[bool, bool, str]:
        if worker is None:
            return True, False, "starting: the engine is being built"
        dead = worker.engine_died
        ready = worker.state is WorkerState.READY and not stop.is_set() and dead is None
        what = worker.state.value + (": stopping" if stop.is_set() else "") + (f": {dead.message}" if dead else "")
        return dead is None, ready, what

    health = HealthServer(ws.health_port, ws.metrics_host, probe).start() if ws.health_port else None
    try:
        if refusal := await queue.refused():  # before the engine is built
            raise refusal
        if engine is None:
            engine = await _create_engine(settings, queue)
        batches = RedisBatches.from_settings(queue.client, queue.keys, settings.batch, replicas=queue.replicas)
        worker = Worker(ws, queue, engine, settings.redis.block_ms, batches, settings.batch, freeze=True)
        await worker.run(stop)
    except EngineDead as exc:
        log.error("worker_exiting_engine_dead", error=str(exc))
        code = 1
    except QueueRefused as exc:  # one line naming why, as a bad setting's
        print(f"error: the worker could not start: {exc.reason}", file=sys.stderr)
        code = 1
    finally:
        if engine is not None:
            try:  # a wedged engine may never shut down: bounded
                await asyncio.wait_for(engine.shutdown(), ws.grace_s + 5)
            except Exception as exc:
                log.error("engine_shutdown_failed", error=f"{type(exc).__name__}: {exc}")
                if worker is not None and worker.wedged:
                    await queue.close()
                    log.info("worker_stopped", exit_code=1, wedged=True)
                    os._exit(1)  # its torch thread cannot be joined
        await queue.close()
        if health is not None:
            health.close()
    log.info("worker_stopped", exit_code=code)
    return code


async def _create_engine(settings: Settings, queue: RedisQueue) -> Engine:
    """Import and build the configured engine, announced as ``starting`` first (the import blocks
    the loop for seconds: torch, vLLM). An engine that cannot be built is announced ``failed`` and
    raises EngineDead."""
    ws = settings.worker
    status = WorkerStatus(
        worker=ws.consumer_name(),
        pool=ws.pool,
        model=ws.model,
        engine=ws.engine,
        max_inflight=ws.max_inflight,
        state=WorkerState.STARTING.value,
        detail=f"importing the {ws.engine} engine",
        since_unix_s=time.time(),
    )
    with contextlib.suppress(QueueUnavailable):
        await queue.heartbeat(status, max(ws.start_timeout_s, ws.heartbeat_ttl_s))
    try:
        return registry.create(settings)
    except (InvalidRequest, ImportError) as exc:
        why = exc.message if isinstance(exc, InvalidRequest) else f"cannot import the {ws.engine} engine: {exc}"
        log.error("engine_start_failed", engine=ws.engine, error=why)
        failed = dataclasses.replace(status, state=WorkerState.FAILED.value, detail=why, since_unix_s=time.time())
        with contextlib.suppress(QueueUnavailable):
            await queue.heartbeat(failed, FAILED_TTL_S)
        raise EngineDead(why) from exc
