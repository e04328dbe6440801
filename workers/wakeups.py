"""Waiting for the first of several things to happen (an event set, a task done, a timeout), as the
worker's loops do; whatever did not happen is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def any_set(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Until one of ``events`` is set, or ``timeout``."""
    await first(*(e.wait() for e in events), timeout=timeout)


async def first(*awaitables: Awaitable[Any], timeout: float | None = None) -> None:
    """Until the first of ``awaitables`` is done (or ``timeout``); the others are cancelled."""
    waiters = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
