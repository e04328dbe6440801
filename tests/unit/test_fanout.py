"""services/http/fanout.merged: several async generators read as one, every one of them closed
however the merge ends (all ended, one failed, the reader stopped), even a source that swallows a
cancellation (as ``asyncio.wait_for`` can on Python < 3.12)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

import pytest

from services.http.fanout import merged

pytestmark = pytest.mark.timeout(10)


async def counting(n: int, closed: list[str], name: str, fail_at: int = -1) -> AsyncGenerator[int, None]:
    try:
        for k in range(n):
            await asyncio.sleep(0)
            if k == fail_at:
                raise ValueError(f"{name} failed")
            yield k
    finally:
        closed.append(name)


async def forever(closed: list[str], name: str, swallow: bool = False) -> AsyncGenerator[int, None]:
    """An item per tick, forever; ``swallow``: the first cancellation is ignored."""
    try:
        k = 0
        while True:
            try:
                await asyncio.sleep(0.001)
            except asyncio.CancelledError:
                if not swallow:
                    raise
                swallow = False
            yield k
            k += 1
    finally:
        closed.append(name)


async def test_every_item_of_every_source_with_its_index() -> None:
    closed: list[str] = []
    got = [x async for x in merged([counting(3, closed, "a"), counting(2, closed, "b")])]
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [k for i, k in got if i == 0] == [0, 1, 2]  # each source's own order
    assert sorted(closed) == ["a", "b"]


async def test_one_source_is_read_in_the_callers_task() -> None:
    closed: list[str] = []
    assert [x async for x in merged([counting(2, closed, "a")])] == [(0, 0), (0, 1)]
    assert closed == ["a"]


async def test_the_first_error_ends_it_and_closes_the_others() -> None:
    closed: list[str] = []
    with pytest.raises(ValueError, match="b failed"):
        async for _ in merged([forever(closed, "a"), counting(5, closed, "b", fail_at=2)]):
            pass
    assert sorted(closed) == ["a", "b"]


async def test_a_reader_that_stops_closes_every_source_even_one_that_swallows_a_cancel() -> None:
    closed: list[str] = []
    sources = [forever(closed, "a", swallow=True), forever(closed, "b"), forever(closed, "c", swallow=True)]
    async with aclosing(merged(sources)) as m:
        async for _, k in m:
            if k == 5:
                break
    assert sorted(closed) == ["a", "b", "c"]
