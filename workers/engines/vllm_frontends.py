"""One vLLM engine core shared by several frontend processes, the way ``vllm serve --api-server-count N``
runs it, with vLLM's own machinery (``launch_core_engines``, ``APIServerProcessManager``).

Why: with one frontend, every engine step's outputs for all running requests (hundreds at high
concurrency) are turned into request outputs, detokenised and published by one Python event loop,
which then lags the GPU. With N frontends each handles 1/N of the requests; the engine core process
routes each request's outputs to the frontend that submitted it.

This module only starts and supervises processes; what runs in each frontend is ``target`` (for the
worker: workers/frontends.py), called by vLLM in a spawned process as
``target(listen_address, sock, args, client_config)``. It never imports redis or grpc.

vLLM 0.26.0 APIs used: ``AsyncEngineArgs._api_process_count`` / ``_api_process_rank`` (as
``vllm serve`` sets them), ``create_engine_config``, ``vllm.v1.executor.Executor.get_class``,
``vllm.v1.engine.utils.get_engine_zmq_addresses`` and ``launch_core_engines``,
``vllm.v1.utils.APIServerProcessManager(target_server_fn=...)`` with ``gather_actual_addresses`` and
``shutdown``, ``vllm.v1.utils.wait_for_completion_or_failure``, the managers' ``shutdown``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import structlog

from llamamesh.settings import VllmSettings, WorkerSettings
from workers.engines.vllm import VllmEngine

log = structlog.get_logger(__name__)

Target = Callable[[str, Any, Any, dict[str, Any]], None]


def split_inflight(max_inflight: int, count: int, index: int) -> int:
    """Frontend ``index``'s share of ``max_inflight`` (the shares add up to it, none below 1)."""
    return max(1, max_inflight // count + (1 if index < max_inflight % count else 0))


def run_with_frontends(
    worker: WorkerSettings, vllm: VllmSettings, target: Target, args: Any, shutdown_timeout_s: float
) -> int:
    """Start the engine core, then ``vllm.frontends`` processes running ``target`` with ``args``;
    supervise them until SIGTERM/SIGINT (forwarded to the frontends, which drain, then the core is
    stopped) or until any of them dies. Returns 0 after a requested stop, 1 when a process died."""
    from vllm.v1.engine.utils import get_engine_zmq_addresses, launch_core_engines
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager, wait_for_completion_or_failure

    n = vllm.frontends
    # The same validation and error naming as a single-process engine.
    engine_args, config = VllmEngine(worker, vllm).engine_config(api_processes=n)
    executor_class = Executor.get_class(config)
    log_stats = not engine_args.disable_log_stats
    addresses = get_engine_zmq_addresses(config, n)

    def on_signal(signum: int, frame: Any) -> None:
        # What vLLM's supervision loop treats as a requested stop (as Ctrl-C): it returns quietly.
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    manager: Any = None
    engines: Any = None
    coordinator: Any = None
    code = 0
    try:
        with launch_core_engines(config, executor_class, log_stats, addresses, n) as (
            engines,
            coordinator,
            addresses,
            tensor_queue,
        ):
            manager = APIServerProcessManager(
                listen_address="",
                sock=None,
                args=args,
                num_servers=n,
                input_addresses=addresses.inputs,
                output_addresses=addresses.outputs,
                target_server_fn=target,
                stats_update_address=coordinator.get_stats_publish_address() if coordinator else None,
                tensor_queue=tensor_queue,
            )
            addresses.inputs, addresses.outputs = manager.gather_actual_addresses()
        log.info("vllm_frontends_started", frontends=n, pids=[p.pid for p in manager.processes])
        wait_for_completion_or_failure(api_server_manager=manager, engine_manager=engines, coordinator=coordinator)
        log.info("vllm_frontends_stopping", frontends=n)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # a frontend or the engine core died (or never started)
        log.error("vllm_frontends_failed", error=f"{type(exc).__name__}: {exc}")
        code = 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if manager is not None:
            manager.shutdown(timeout=shutdown_timeout_s)  # SIGTERM: each frontend drains its jobs
            code = code or max((p.exitcode or 0 for p in manager.processes), default=0)
        if engines is not None:
            engines.shutdown(timeout=10)
        if coordinator is not None:
            coordinator.shutdown(timeout=10)
    return 1 if code else 0
