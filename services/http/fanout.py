"""Several response streams as one: a completions request of several prompts is one generation per
prompt, and the door answers them together, each message with the index of its prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TypeVar, cast

T = TypeVar("T")

_END = object()
# How often the sources still open are cancelled again while the merge closes: on Python < 3.12 an
# ``asyncio.wait_for`` whose awaitable completes as it is cancelled swallows the cancellation.
_RECANCEL_S = 0.05


async def merged(sources: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Each source's items as they come, with the source's index, until every source has ended.
    The first error of any source ends the merge with that error; every source still open is then
    closed (for a generation: cancelled), as all are when the caller stops early. One source is
    read in the caller's own task."""
    if len(sources) == 1:
        async with aclosing(sources[0]) as only:
            async for item in only:
                yield 0, item
        return
    # Bounded: a slow caller slows every source rather than buffering them.
    queue: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue(maxsize=2 * len(sources))
    closing = False

    async def pump(i: int, source: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(source) as s:
                async for item in s:
                    await queue.put((i, item, None))
                    if closing:
                        return
            await queue.put((i, _END, None))
        except Exception as exc:  # the reader raises it (a cancellation is not one)
            await queue.put((i, _END, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        open_ = len(tasks)
        while open_:
            i, got, exc = await queue.get()
            if exc is not None:
                raise exc
            if got is _END:
                open_ -= 1
                continue
            yield i, cast(T, got)
    finally:
        closing = True
        pending = [t for t in tasks if not t.done()]
        while pending:
            for t in pending:
                t.cancel()
            while not queue.empty():  # a source blocked on the full queue goes on to see ``closing``
                queue.get_nowait()
            _, left = await asyncio.wait(pending, timeout=_RECANCEL_S)
            pending = list(left)
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved: an error after the first is not logged as unread
