"""The tests' own waiting helpers (tests/waiting.py): the first value that holds, a bounded wait
that names what it waited for, sync and async checks, a scheduler turn or an event between looks."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import until, wait_until

pytestmark = pytest.mark.timeout(10)


async def test_until_returns_the_first_value_that_holds_of_a_sync_or_an_async_check() -> None:
    counts = itertools.count()
    assert await until(lambda: next(counts) >= 3 and "three", 5, "three looks") == "three"

    async def later() -> list[int]:
        n = next(counts)
        return [n] if n >= 6 else []

    assert await until(later, 5, "six looks") == [6]


async def test_until_fails_naming_what_it_waited_for_and_with_done_the_last_value() -> None:
    with pytest.raises(TimeoutError, match=r"timed out after 0.05 s waiting for the impossible$"):
        await until(lambda: False, 0.05, "the impossible")
    counts = itertools.count()
    with pytest.raises(TimeoutError, match=r"waiting for a negative count; last seen: \d+"):
        await until(lambda: next(counts), 0.05, "a negative count", done=lambda n: n < 0)


async def test_what_a_check_raises_propagates() -> None:
    def broken() -> bool:
        raise ValueError("broken check")

    with pytest.raises(ValueError, match="broken check"):
        await until(broken, 5, "a broken check")


async def test_a_zero_poll_looks_again_each_scheduler_turn() -> None:
    ran: list[int] = []

    async def step() -> None:
        for i in range(3):
            ran.append(i)
            await asyncio.sleep(0)

    task = asyncio.create_task(step())
    await until(lambda: ran == [0, 1], 5, "the second step", poll_s=0)
    assert ran == [0, 1]  # looked at before the third step ran
    await task


async def test_a_wake_event_looks_again_when_it_is_set_not_on_a_clock() -> None:
    wake, value = asyncio.Event(), [0]

    async def bump() -> None:
        for _ in range(3):
            await asyncio.sleep(0.01)
            value[0] += 1
            wake.set()

    task = asyncio.create_task(bump())
    assert await until(lambda: value[0], 5, "a bump", done=lambda n: n >= 3, poll_s=3600, wake=wake) == 3
    await task


def test_wait_until_blocks_and_fails_alike() -> None:
    counts = itertools.count()
    assert wait_until(lambda: next(counts), 5, "the third look", done=lambda n: n == 2, poll_s=0.001) == 2
    with pytest.raises(TimeoutError, match=r"waiting for a miracle; last seen: 'no'"):
        wait_until(lambda: "no", 0.05, "a miracle", done=lambda s: s == "yes")
