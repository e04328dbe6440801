"""How tests wait: a condition polled within a bound, from the event loop (``until``) or from a
thread watching other processes (``wait_until``), each failing with what it waited for; and the
event tests most often wait for on Redis, a client blocked in a read (``blocked_in``)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import redis.asyncio as aioredis

T = TypeVar("T")

# Between two looks at a condition: of this process or of Redis, and of another process.
POLL_S = 0.01
PROCESS_POLL_S = 0.05


@overload
async def until(
    check: Callable[[], Awaitable[T]],
    timeout_s: float,
    what: str,
    *,
    done: Callable[[T], object] | None = None,
    poll_s: float = POLL_S,
    wake: asyncio.Event | None = None,
) -> T: ...


@overload
async def until(
    check: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    done: Callable[[T], object] | None = None,
    poll_s: float = POLL_S,
    wake: asyncio.Event | None = None,
) -> T: ...


async def until(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    *,
    done: Callable[[Any], object] | None = None,
    poll_s: float = POLL_S,
    wake: asyncio.Event | None = None,
) -> Any:
    """The first value of ``check()`` (sync or async) that holds: ``done(value)``, else its truth.

    Between two calls it waits ``poll_s`` (0: one scheduler turn, for what the next turn decides),
    or, given ``wake``, until that event is set. Raises TimeoutError naming ``what`` (and, given
    ``done``, the last value seen) once ``timeout_s`` passed; what ``check`` raises propagates."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if wake is not None:
            wake.clear()  # before the look: whatever changes after it sets the event again
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if (done or bool)(value):
            return value
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError(_timed_out(timeout_s, what, value, done is not None))
        if wake is None:
            await asyncio.sleep(min(poll_s, left))
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), left)


def wait_until(
    ok: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    done: Callable[[T], object] | None = None,
    poll_s: float = PROCESS_POLL_S,
) -> T:
    """``until`` for a thread (or a test without an event loop) watching other processes: blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = ok()
        if (done or bool)(value):
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(_timed_out(timeout_s, what, value, done is not None))
        time.sleep(min(poll_s, left))


def _timed_out(timeout_s: float, what: str, last: object, show_last: bool) -> str:
    said = f"timed out after {timeout_s:g} s waiting for {what}"
    return f"{said}; last seen: {last!r}" if show_last else said


async def blocked_in(client: aioredis.Redis | aioredis.RedisCluster, command: str, name: str | None = None) -> int:
    """How many clients of the server (of every master and replica of a cluster) are blocked in
    ``command`` ("xread", "xreadgroup"): CLIENT LIST's ``cmd`` with the ``b`` flag; only those
    named ``name`` when given."""
    if isinstance(client, aioredis.RedisCluster):
        listed: Any = await client.client_list(target_nodes=aioredis.RedisCluster.ALL_NODES)
    else:
        listed = await client.client_list()
    clients = [c for node in listed.values() for c in node] if isinstance(listed, dict) else listed
    blocked = [c for c in clients if c.get("cmd") == command.lower() and "b" in c.get("flags", "")]
    return sum(1 for c in blocked if name is None or c.get("name") == name)
