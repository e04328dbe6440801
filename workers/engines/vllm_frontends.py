"""One vLLM engine core shared by several frontend processes, the way ``vllm serve --api-server-count
N`` runs it, with vLLM's own machinery: the vllm engine's SharedCore process mode
(workers/engines/registry.py). This module only starts and supervises processes, and builds each
frontend's engine; what runs in a frontend is ``target`` (for the worker: workers/frontends.py). It
never imports redis or grpc.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import structlog

from llamamesh.settings import Settings
from workers.engines.base import Engine
from workers.engines.registry import Target
from workers.engines.vllm import VllmEngine
from workers.engines.vllm_args import CoreClient, engine_config, for_worker

log = structlog.get_logger(__name__)


class VllmCore:
    """The engine core and ``vllm.frontends`` frontend processes (registry.SharedCore).

    Why: with one frontend, every engine step's outputs for all running requests (hundreds at high
    concurrency) are turned into request outputs, detokenised and published by one Python event loop,
    which then lags the GPU. With N frontends each handles 1/N of the requests; the engine core
    process routes each request's outputs to the frontend that submitted it.

    vLLM 0.26.0 APIs used: ``create_engine_config`` (vllm_args.py, with ``AsyncEngineArgs.
    _api_process_count`` / ``_api_process_rank`` as ``vllm serve`` sets them),
    ``vllm.v1.executor.Executor.get_class``, ``vllm.v1.engine.utils.get_engine_zmq_addresses`` and
    ``launch_core_engines``, ``vllm.v1.utils.APIServerProcessManager(target_server_fn=...)`` with
    ``gather_actual_addresses`` and ``shutdown``, ``vllm.v1.utils.wait_for_completion_or_failure``, the
    managers' ``shutdown``; the ``client_count`` / ``client_index`` of the ``client_config`` each
    frontend is given."""

    def run(self, settings: Settings, target: Target, shutdown_timeout_s: float) -> int:
        """Start the engine core, then ``vllm.frontends`` processes running ``target`` with ``settings``;
        supervise them until SIGTERM/SIGINT (forwarded to the frontends, which drain, then the core is
        stopped) or until any of them dies. Returns 0 after a requested stop, 1 when a process died.
        vLLM calls ``target(listen_address, sock, args, client_config)`` in each spawned frontend."""
        from vllm.v1.engine.utils import get_engine_zmq_addresses
        from vllm.v1.executor import Executor

        # The step budget from what the worker serves, once: the core and every frontend see the same.
        settings = replace(settings, vllm=for_worker(settings.vllm, settings.batch))
        n = settings.vllm.frontends
        # The same validation and error naming as a single-process engine.
        engine_args, config = engine_config(settings.worker, settings.vllm, api_processes=n)
        processes = _Processes(
            config,
            Executor.get_class(config),
            not engine_args.disable_log_stats,
            get_engine_zmq_addresses(config, n),
            n,
        )
        code = 0
        try:
            with _signals_stop():
                processes.start(target, settings)
                processes.wait()
        except KeyboardInterrupt:
            pass
        except Exception as exc:  # a frontend or the engine core died (or never started)
            log.error("vllm_frontends_failed", error=f"{type(exc).__name__}: {exc}")
            code = 1
        finally:
            code = processes.stop(shutdown_timeout_s) or code
        return 1 if code else 0

    def place(self, client_config: dict[str, Any]) -> tuple[int, int]:
        """(frontends, this one's index), from the ``client_config`` vLLM gave the frontend."""
        return int(client_config["client_count"]), int(client_config["client_index"])

    def engine(self, settings: Settings, client_config: dict[str, Any], constraints: Any) -> Engine:
        """One frontend's engine: its own AsyncLLM client of the shared core."""
        config = dict(client_config)
        count, index = int(config.pop("client_count")), int(config.pop("client_index"))
        vllm = for_worker(settings.vllm, settings.batch)
        return VllmEngine(settings.worker, vllm, constraints=constraints, core=CoreClient(config, count, index))


@contextmanager
def _signals_stop() -> Iterator[None]:
    """SIGTERM and SIGINT as KeyboardInterrupt meanwhile: what vLLM's supervision loop treats as a
    requested stop (as Ctrl-C); it returns quietly."""

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class _Processes:
    """vLLM's process managers: the engine core(s), its coordinator, the frontends."""

    def __init__(self, config: Any, executor_class: Any, log_stats: bool, addresses: Any, n: int) -> None:
        self._config, self._executor_class, self._log_stats = config, executor_class, log_stats
        self._addresses, self._n = addresses, n
        self.manager: Any = None
        self.engines: Any = None
        self.coordinator: Any = None

    def start(self, target: Target, args: Any) -> None:
        from vllm.v1.engine.utils import launch_core_engines
        from vllm.v1.utils import APIServerProcessManager

        with launch_core_engines(self._config, self._executor_class, self._log_stats, self._addresses, self._n) as (
            self.engines,
            self.coordinator,
            addresses,
            tensor_queue,
        ):
            coordinator = self.coordinator
            self.manager = APIServerProcessManager(
                listen_address="",
                sock=None,
                args=args,
                num_servers=self._n,
                input_addresses=addresses.inputs,
                output_addresses=addresses.outputs,
                target_server_fn=target,
                stats_update_address=coordinator.get_stats_publish_address() if coordinator else None,
                tensor_queue=tensor_queue,
            )
            addresses.inputs, addresses.outputs = self.manager.gather_actual_addresses()
        log.info("vllm_frontends_started", frontends=self._n, pids=[p.pid for p in self.manager.processes])

    def wait(self) -> None:
        """Until a frontend or the engine core ends (or a signal)."""
        from vllm.v1.utils import wait_for_completion_or_failure

        wait_for_completion_or_failure(
            api_server_manager=self.manager, engine_manager=self.engines, coordinator=self.coordinator
        )
        log.info("vllm_frontends_stopping", frontends=self._n)

    def stop(self, shutdown_timeout_s: float) -> int:
        """Stop every process; the frontends' worst exit code (0 when none started)."""
        code = 0
        if self.manager is not None:
            self.manager.shutdown(timeout=shutdown_timeout_s)  # SIGTERM: each frontend drains its jobs
            code = max((p.exitcode or 0 for p in self.manager.processes), default=0)
        if self.engines is not None:
            self.engines.shutdown(timeout=10)
        if self.coordinator is not None:
            self.coordinator.shutdown(timeout=10)
        return code
