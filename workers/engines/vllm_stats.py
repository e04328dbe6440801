"""The vllm engine's figures: the latest scheduler figures of each vLLM engine core (running, waiting,
KV cache usage), kept by a vLLM stat logger beside vLLM's own, for the worker's heartbeat.

vLLM API used: ``vllm.v1.metrics.loggers.StatLoggerBase`` (``record(scheduler_stats, ...)`` with
``SchedulerStats`` ``num_running_reqs``, ``num_waiting_reqs``, ``num_skipped_waiting_reqs``,
``kv_cache_usage``), imported by :func:`stat_logger_factory` when called."""

from __future__ import annotations

from typing import Any

from workers.engines.base import EngineStats


class SchedulerSnapshot:
    """The latest scheduler figures of each vLLM engine core (fed by a vLLM stat logger)."""

    def __init__(self) -> None:
        self._by_engine: dict[int, tuple[int, int, float]] = {}

    def record(self, engine_idx: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        self._by_engine[engine_idx] = (running, waiting, kv_cache_usage)

    def stats(self) -> EngineStats:
        if not self._by_engine:
            return EngineStats()
        rows = self._by_engine.values()
        return EngineStats(
            running=sum(r[0] for r in rows),
            waiting=sum(r[1] for r in rows),
            kv_cache_usage=sum(r[2] for r in rows) / len(rows),
        )


def stat_logger_factory(snapshot: SchedulerSnapshot) -> Any:
    """A per-engine vLLM stat logger factory keeping ``snapshot`` up to date (vLLM's own loggers stay)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                snapshot.record(
                    engine_idx,
                    scheduler_stats.num_running_reqs,
                    scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                    scheduler_stats.kv_cache_usage,
                )

        def log_engine_initialized(self) -> None:
            pass

    return lambda vllm_config, engine_index: SnapshotStatLogger(vllm_config, engine_index)
