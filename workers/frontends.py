"""A vLLM worker as several processes sharing one engine core (``LLAMAMESH_VLLM_FRONTENDS`` > 1).

The supervising process starts the engine core and the frontends with vLLM's own process managers
(workers/engines/vllm_frontends.py). Each frontend is a complete worker (workers/worker.py): its
own consumer in the pool's group (``<consumer>-<index>``), its share of ``max_inflight``, its own
AsyncLLM client, leasing and event publishing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

import structlog

from llamamesh import logs, metrics
from llamamesh.loop import run_main
from llamamesh.settings import Settings, prometheus_multiproc_dir
from workers.engines.vllm import CoreClient, VllmEngine, for_worker
from workers.engines.vllm_frontends import run_with_frontends, split_inflight
from workers.health import supervisor_health
from workers.process import serve

log = structlog.get_logger(__name__)


def frontend_settings(settings: Settings, count: int, index: int) -> Settings:
    return settings.with_overrides(
        worker={
            "consumer": f"{settings.worker.consumer_name()}-{index}",
            "max_inflight": split_inflight(settings.worker.max_inflight, count, index),
        }
    )


def run_frontend(listen_address: str, sock: Any, settings: Settings, client_config: dict[str, Any]) -> None:
    """One frontend process (vLLM's APIServerProcessManager calls this, in a spawned process)."""
    config = dict(client_config)
    count, index = int(config.pop("client_count")), int(config.pop("client_index"))
    settings = frontend_settings(settings, count, index)
    logs.configure(settings.log, f"worker-{index}")
    engine = VllmEngine(settings.worker, settings.vllm, core=CoreClient(config, count, index))
    sys.exit(run_main(serve(settings, engine)))


def run_frontends(settings: Settings) -> int:
    """The supervising process: the engine core plus ``vllm.frontends`` frontends; returns the exit code."""
    structlog.contextvars.bind_contextvars(worker=settings.worker.consumer_name(), pool=settings.worker.pool)
    # The step budget from what the worker serves, once: the core and every frontend see the same.
    settings = replace(settings, vllm=for_worker(settings.vllm, settings.batch))
    log.info("engine_starting", engine="vllm", model=settings.worker.model, frontends=settings.vllm.frontends)
    # One scrape for all frontends: vLLM spawns them with this process's environment, so the
    # directory they write into goes there (prometheus_client reads it when they import it).
    ws = settings.worker
    agg = metrics.Aggregate(ws.metrics_port, ws.metrics_host, "worker", prometheus_multiproc_dir())
    os.environ.update(agg.children_env())
    health = supervisor_health(settings, [frontend_settings(settings, settings.vllm.frontends, i).worker.consumer_name()
                                          for i in range(settings.vllm.frontends)])  # fmt: skip
    settings = settings.with_overrides(worker={"metrics_port": 0, "health_port": 0})
    try:
        # Frontends drain for grace_s after SIGTERM; the rest is their engine shutdown.
        return run_with_frontends(
            settings.worker, settings.vllm, run_frontend, settings, shutdown_timeout_s=settings.worker.grace_s + 15
        )
    finally:
        agg.close()
        if health is not None:
            health.close()
