"""Teardown shared by tests that run a gateway and a worker in-process over real Redis."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_in_process(stop: asyncio.Event, task: asyncio.Task[Any], gateway: Any, engine: Any,
                          *queues: Any) -> None:  # fmt: skip
    """Stop the worker (``stop``, its ``task`` awaited at most 10 s), the gateway at once, the
    engine, then close the queues."""
    stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)
    await gateway.stop(0)
    await engine.shutdown()
    for q in queues:
        await q.close()
