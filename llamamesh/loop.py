"""The event loop of llamamesh's processes: uvloop where it is installed (a dependency everywhere
but Windows), else asyncio's own. The gateway's relay and a worker's hundreds of job tasks are
loop-bound: every relayed message is a few loop callbacks on each side."""

from __future__ import annotations

import asyncio
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
