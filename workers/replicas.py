"""One worker process per group of GPUs (ProcessMode.REPLICAS): data parallelism through the queue.
A GPU engine spans the GPUs its registry entry's ``devices_field`` says (``tensor_parallel_size``:
vLLM's and TensorRT-LLM's own executors do the sharding); when that setting is given (k >= 1) and the
host shows more GPUs than k, the worker command becomes a supervisor of n // k worker processes, each
seeing its own k GPUs. The default (0) keeps one worker over every visible GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import structlog

from llamamesh import metrics
from llamamesh.errors import InvalidRequest
from llamamesh.settings import Settings, prometheus_multiproc_dir
from llamamesh.supervisor import Child, Supervisor
from workers.engines.registry import EngineSpec
from workers.health import supervisor_health

log = structlog.get_logger(__name__)


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else what nvidia-smi lists
    (none without it). Does not touch CUDA, so the replicas can still pick their devices."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def visible() -> list[str]:
    """The GPUs this process may use, from its own environment (CUDA_VISIBLE_DEVICES is CUDA's
    variable, not a setting; the replicas get this environment)."""
    return visible_gpus(os.environ)


def replica_gpus(gpus: list[str], tp: int, field: str) -> list[list[str]]:
    """The GPU groups of the replicas; [] when one worker takes them all (``tp`` 0, or no more GPUs
    than ``tp``). InvalidRequest on ``field`` when the GPUs do not split into groups of ``tp``."""
    if tp <= 0 or len(gpus) <= tp:
        return []
    if len(gpus) % tp:
        listed = ",".join(gpus)
        raise InvalidRequest.field(field, f"{len(gpus)} visible GPUs ({listed}) do not split into groups of {tp}")
    return [gpus[i : i + tp] for i in range(0, len(gpus), tp)]


def replica_groups(settings: Settings, spec: EngineSpec, gpus: list[str]) -> list[list[str]]:
    """The groups of the visible ``gpus`` that ``spec``'s replicas take for these settings; [] when one
    worker takes them all. InvalidRequest on its devices setting when they do not split into groups."""
    return replica_gpus(gpus, spec.devices_per_engine(settings), spec.devices_setting)


def run_replicas(settings: Settings, groups: list[list[str]]) -> int:
    """Run one ``python -m workers`` per GPU group until a signal (forwarded: they drain), restarting
    any that dies. Returns 0, or 1 if one had to be killed at the end.

    Each replica sees its own GPUs (``CUDA_VISIBLE_DEVICES``) and leases from the pool as consumer
    ``<name>-r<i>``. The supervisor is llamamesh/supervisor.py, the same one the node and the gateway
    use: a replica that dies is started again with backoff (its GPUs and consumer name stay its own,
    so it takes its own leased jobs first) while the others go on serving; one that keeps dying is
    reported as crash-looping and retried at the longest backoff."""
    base = settings.worker.consumer_name()
    ws = settings.worker
    # One scrape for all replicas: they write into one directory, served here.
    agg = metrics.Aggregate(ws.metrics_port, ws.metrics_host, "worker", prometheus_multiproc_dir())
    children = []
    for i, group in enumerate(groups):
        consumer = f"{base}-r{i}"
        child_env = {
            "CUDA_VISIBLE_DEVICES": ",".join(group),
            "LLAMAMESH_WORKER_CONSUMER": consumer,
            "LLAMAMESH_WORKER_METRICS_PORT": "0",
            "LLAMAMESH_WORKER_HEALTH_PORT": "0",
            **agg.children_env(),
        }
        children.append(Child(f"replica-{i}", (sys.executable, "-m", "workers"), child_env))
    sup = Supervisor(children, on_exit=lambda state: agg.process_dead(state.pid))
    health = supervisor_health(settings, [c.env["LLAMAMESH_WORKER_CONSUMER"] for c in children])
    sup.start()
    for i, (group, state) in enumerate(zip(groups, sup.states.values(), strict=True)):
        log.info(
            "replica_started",
            replica=i,
            pid=state.pid,
            gpus=",".join(group),
            consumer=state.child.env["LLAMAMESH_WORKER_CONSUMER"],
        )
    try:
        sup.run()
    finally:
        code = sup.stop(settings.worker.grace_s + 15)
        agg.close()
        if health is not None:
            health.close()
    log.info("replicas_stopped", exit_code=code)
    return code
