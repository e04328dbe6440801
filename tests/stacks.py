"""What tests that run a gateway (and a worker) in this process share: a gateway started on a free
port and stopped on the way out, and the teardown of a gateway and a worker over real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from llamamesh.queue.memory import MemoryQueue
from llamamesh.queue.protocol import JobQueue
from llamamesh.settings import GatewaySettings
from services.server import Gateway, start_gateway


@contextlib.asynccontextmanager
async def gateway_in_process(
    settings: GatewaySettings, queue: JobQueue | None = None, **options: Any
) -> AsyncIterator[Gateway]:
    """A gateway over ``queue`` (a fresh fake one by default) on a free port, with start_gateway's
    ``options`` (auth, batches, ...); stopped at once on the way out."""
    queue = MemoryQueue() if queue is None else queue
    gw = await start_gateway(queue, dataclasses.replace(settings, port=0), port=0, **options)
    try:
        yield gw
    finally:
        await gw.stop(0)


async def stop_in_process(
    stop: asyncio.Event, task: asyncio.Task[Any], gateway: Any, engine: Any, *queues: Any
) -> None:
    """Stop the worker (``stop``, its ``task`` awaited at most 10 s), the gateway at once, the
    engine, then close the queues."""
    stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)
    await gateway.stop(0)
    await engine.shutdown()
    for q in queues:
        await q.close()
