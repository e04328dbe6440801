"""``python -m workers``: the worker command. It runs the configured engine in the process mode its
registry entry picks (workers/engines/registry.py): one worker process, several frontends sharing one
engine core, or one replica per group of GPUs."""

from __future__ import annotations

import functools
import sys

from llamamesh import logs, tracing
from llamamesh.loop import run_main
from llamamesh.settings import Settings, adapter_table
from workers.engines.prompts import read_chat_template
from workers.engines.registry import ENGINES, ProcessMode
from workers.frontends import run_frontends
from workers.process import serve
from workers.replicas import replica_groups, run_replicas, visible


def run(settings: Settings) -> int:
    """Run the worker until a signal (or its engine's end); returns the exit code. An engine the
    registry does not know runs as one process, which reports it (failed, with why)."""
    spec = ENGINES.get(settings.worker.engine)
    gpus = functools.cache(visible)  # asked at most once, and only for an engine that spans GPUs
    mode = spec.process_mode(settings, gpus) if spec is not None else ProcessMode.ONE_PROCESS
    if spec is not None and mode is ProcessMode.REPLICAS:
        return run_replicas(settings, replica_groups(settings, spec, gpus()))
    if spec is not None and mode is ProcessMode.FRONTENDS:
        return run_frontends(settings, spec)
    return run_main(serve(settings))


def main() -> None:
    """The worker command; a bad setting exits 1 with one line naming it."""
    try:
        settings = Settings.from_env()
        read_chat_template(settings.worker.chat_template)
        adapter_table(settings.worker.adapters)
        if not settings.worker.pool.strip():
            raise ValueError("LLAMAMESH_WORKER_POOL: empty; name the pool this worker serves")
        settings.checked_for_process()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    logs.configure(settings.log, "worker")
    tracing.configure("worker")
    try:
        code = run(settings)
    except OSError as exc:  # a port of its own it cannot listen on (health, metrics)
        print(f"error: the worker could not start: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
