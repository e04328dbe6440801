"""The event loop of llamamesh's processes: uvloop where it is installed (a dependency everywhere
but Windows), else asyncio's own. The gateway's relay and a worker's hundreds of job tasks are
loop-bound: every relayed message is a few loop callbacks on each side, and a pause of the loop
(a garbage collection of the whole heap) delays every stream at once."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
EVENT_LOOPS = ("uvloop", "asyncio")


def run_main(coro: Coroutine[Any, Any, T], kind: str = "uvloop") -> T:
    """Run ``coro`` on ``kind``'s loop ("uvloop": uvloop if it is installed, else asyncio's)."""
    if kind not in EVENT_LOOPS:
        coro.close()
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, not {kind!r}")
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


# The youngest generation's collection threshold once serving (CPython's default: 700 allocations).
SERVING_GC_THRESHOLD = 10_000


def serving_heap() -> int:
    """Once a process has started serving: collect, then move every object alive now (modules,
    grpc, protobuf descriptors, the engine's objects) out of the garbage collector's reach, so a
    full collection scans only what serving allocated since; and collect the youngest generation
    every ``SERVING_GC_THRESHOLD`` allocations instead of 700. Returns the objects frozen.

    The heap after start-up is almost all long-lived; without the freeze each full collection
    walks it all, stopping every stream at once. With 700, the objects of a streaming call (its
    task, generators, messages) survive into the older generations and their full collections come
    often; at 10 000 most die young (docs/benchmarks.md; vLLM's API server freezes its heap after
    start-up the same way). What is frozen is never freed, so call it once, after start-up, not per
    request."""
    gc.collect()
    gc.freeze()
    _g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(SERVING_GC_THRESHOLD, g1, g2)
    return gc.get_freeze_count()


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, again_s: float = 0.1) -> None:
    """Cancel ``tasks`` (None: none) and return once each has ended, whatever it ended with. A
    cancellation can be lost inside a library (one that arrives just as a Redis reply does), and a
    periodic loop then runs on to its next wait: a task still running after ``again_s`` is cancelled
    again, so that a stop never waits out a loop's interval or hangs."""
    given = [t for t in tasks if t is not None]
    pending = set(given)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_s)
    for t in given:
        if not t.cancelled():
            t.exception()  # retrieved: an ending error is the task's own to log
