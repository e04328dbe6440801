"""The follower's inbox (llamamesh/queue/follow.py): entries in order, None after an idle period
counted from the last entry, and no timer per entry."""

from __future__ import annotations

import asyncio

from llamamesh.queue.follow import Inbox
from tests.waiting import until


async def test_entries_in_order_and_none_when_idle() -> None:
    box = Inbox()
    box.put_nowait(("1-0", {}))
    box.put_nowait(("2-0", {}))
    assert await box.get_within(0.05) == ("1-0", {})
    assert await box.get_within(0.05) == ("2-0", {})
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await box.get_within(0.05) is None
    assert loop.time() - t0 >= 0.04
    box.close()


async def test_an_entry_restarts_the_idle_period() -> None:
    box = Inbox()
    loop = asyncio.get_running_loop()

    async def feed() -> None:
        for i in range(5):
            await asyncio.sleep(0.02)  # time passing on purpose: entries 20 ms apart, under the idle period
            box.put_nowait((f"{i}-0", {}))

    feeder = asyncio.create_task(feed())
    got = [await box.get_within(0.06) for _ in range(5)]
    await feeder
    assert got == [(f"{i}-0", {}) for i in range(5)]  # 20 ms apart: never idle for 60 ms
    t0 = loop.time()
    assert await box.get_within(0.06) is None
    assert loop.time() - t0 >= 0.05
    box.close()


async def test_one_timer_per_idle_period_not_per_entry() -> None:
    box = Inbox()
    loop = asyncio.get_running_loop()
    armed = 0
    call_at, call_later = loop.call_at, loop.call_later

    def counting_at(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal armed
        armed += 1
        return call_at(*args, **kwargs)

    def counting_later(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal armed
        armed += 1
        return call_later(*args, **kwargs)

    loop.call_at, loop.call_later = counting_at, counting_later  # type: ignore[method-assign]
    try:

        async def feed() -> None:
            for i in range(50):
                await asyncio.sleep(0)  # pacing, not waiting: one entry per loop turn
                box.put_nowait((f"{i}-0", {}))

        feeder = asyncio.create_task(feed())
        for _ in range(50):
            assert await box.get_within(10.0) is not None
        await feeder
    finally:
        loop.call_at, loop.call_later = call_at, call_later  # type: ignore[method-assign]
        box.close()
    assert armed <= 2  # asyncio.wait_for would have armed 50


async def test_get_after_cancel_still_gets() -> None:
    box = Inbox()
    waiter = asyncio.create_task(box.get())
    await until(lambda: box._waiter is not None, 5, "the getter to wait", poll_s=0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    box.put_nowait(("1-0", {}))
    assert await asyncio.wait_for(box.get(), 1) == ("1-0", {})
