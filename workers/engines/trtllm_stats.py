"""The trtllm engine's figures: running, waiting and KV cache usage from TensorRT-LLM's iteration stats
(``LLM.get_stats_async``), polled by a task the engine owns.

Written from TensorRT-LLM's documentation and source only, never run against it (see trtllm.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import structlog

log = structlog.get_logger(__name__)

STATS_INTERVAL_S = 1.0


def stat_figures(stat: Any) -> tuple[int, int, float] | None:
    """(running, waiting, kv_cache_usage) from one iteration-stats entry, or None if it has none of them.
    IterationResult yields dicts (json.loads of the runtime's JSON); a str is parsed the same way."""
    if isinstance(stat, (str, bytes)):
        stat = json.loads(stat)
    if not isinstance(stat, Mapping) or "numActiveRequests" not in stat:
        return None
    kv = stat.get("kvCacheStats") or {}
    used = int(kv.get("usedNumBlocks", 0))
    total = int(kv.get("maxNumBlocks", 0)) or used + int(kv.get("freeNumBlocks", 0))
    return int(stat["numActiveRequests"]), int(stat.get("numQueuedRequests", 0)), used / total if total else 0.0


class IterationStats:
    """The latest figures from TensorRT-LLM's iteration stats."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.running = self.waiting = 0
        self.kv_cache_usage = 0.0

    async def drain(self, llm: Any) -> int:
        """Take the iteration stats as they come (one per engine step while busy) until none came for
        ``interval_s`` (IterationResult then ends, and stays ended until the next request); returns
        how many held figures. A failure is logged: stats are not worth the worker.

        ``LLM.get_stats_async(timeout)``: an ``IterationResult``, async iterable of per-iteration
        dicts (tensorrt_llm/llmapi/llm.py; executor/executor.py ``aget_stats``; executor/result.py
        ``IterationResult``), with keys ``numActiveRequests``, ``numQueuedRequests``,
        ``kvCacheStats.usedNumBlocks`` / ``maxNumBlocks`` / ``freeNumBlocks``; the PyTorch backend
        produces them only with ``enable_iter_perf_stats``."""
        seen = 0
        try:
            async for stat in llm.get_stats_async(timeout=self.interval_s):
                figures = stat_figures(stat)
                if figures is not None:
                    seen += 1
                    self.running, self.waiting, self.kv_cache_usage = figures
        except Exception as exc:
            log.warning("trtllm_stats_failed", error=f"{type(exc).__name__}: {exc}")
        return seen

    def idle(self) -> None:
        """No entry and no request in flight: an idle engine yields none."""
        self.running = self.waiting = 0
