"""A worker as several processes sharing one engine core (ProcessMode.FRONTENDS: the engine's
``frontends`` setting above 1, e.g. ``LLAMAMESH_VLLM_FRONTENDS``).

The supervising process starts the engine core and the frontends with the engine's SharedCore
(workers/engines/registry.py). Each frontend is a complete worker (workers/worker.py): its own
consumer in the pool's group (``<consumer>-<index>``), its share of ``max_inflight``, its own client
of the core, leasing and event publishing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import structlog

from llamamesh import logs, metrics
from llamamesh.loop import run_main
from llamamesh.settings import Settings, prometheus_multiproc_dir
from workers.engines.registry import EngineSpec, SharedCore, spec_of
from workers.health import supervisor_health
from workers.process import serve

log = structlog.get_logger(__name__)


def split_inflight(max_inflight: int, count: int, index: int) -> int:
    """Frontend ``index``'s share of ``max_inflight`` (the shares add up to it, none below 1)."""
    return max(1, max_inflight // count + (1 if index < max_inflight % count else 0))


def frontend_settings(settings: Settings, count: int, index: int) -> Settings:
    return settings.with_overrides(
        worker={
            "consumer": f"{settings.worker.consumer_name()}-{index}",
            "max_inflight": split_inflight(settings.worker.max_inflight, count, index),
        }
    )


def _core(spec: EngineSpec) -> SharedCore:
    if spec.shared_core is None:
        raise ValueError(f"the {spec.name} engine has no shared core")
    return spec.shared_core()


def run_frontend(listen_address: str, sock: Any, settings: Settings, client_config: dict[str, Any]) -> None:
    """One frontend process (the shared core's process manager calls this, in a spawned process)."""
    spec = spec_of(settings.worker.engine)
    core = _core(spec)
    count, index = core.place(client_config)
    settings = frontend_settings(settings, count, index)
    logs.configure(settings.log, f"worker-{index}")
    engine = core.engine(settings, client_config, spec.constraints)
    sys.exit(run_main(serve(settings, engine)))


def run_frontends(settings: Settings, spec: EngineSpec) -> int:
    """The supervising process: the engine core plus its frontends; returns the exit code."""
    structlog.contextvars.bind_contextvars(worker=settings.worker.consumer_name(), pool=settings.worker.pool)
    n = spec.frontends(settings)
    log.info("engine_starting", engine=spec.name, model=settings.worker.model, frontends=n)
    # One scrape for all frontends: they are spawned with this process's environment, so the
    # directory they write into goes there (prometheus_client reads it when they import it).
    ws = settings.worker
    agg = metrics.Aggregate(ws.metrics_port, ws.metrics_host, "worker", prometheus_multiproc_dir())
    os.environ.update(agg.children_env())
    health = supervisor_health(settings, [frontend_settings(settings, n, i).worker.consumer_name() for i in range(n)])
    settings = settings.with_overrides(worker={"metrics_port": 0, "health_port": 0})
    try:
        # Frontends drain for grace_s after SIGTERM; the rest is their engine shutdown.
        return _core(spec).run(settings, run_frontend, shutdown_timeout_s=settings.worker.grace_s + 15)
    finally:
        agg.close()
        if health is not None:
            health.close()
