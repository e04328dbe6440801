"""llamamesh/loop.py: the loop a gateway or worker process runs on (LLAMAMESH_GATEWAY_EVENT_LOOP)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import uvloop

from llamamesh.loop import cancel_and_wait, run_main

pytestmark = pytest.mark.timeout(60)


async def loop_type() -> type:
    await asyncio.sleep(0)  # not a wait: a main that yields to its loop once
    return type(asyncio.get_running_loop())


def test_uvloop_by_default_and_asyncio_on_request() -> None:
    assert run_main(loop_type()) is uvloop.Loop
    assert run_main(loop_type(), "uvloop") is uvloop.Loop
    assert not issubclass(run_main(loop_type(), "asyncio"), uvloop.Loop)


def test_an_unknown_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="uvloop, asyncio, not 'trio'"):
        run_main(loop_type(), "trio")


def test_a_gateway_with_an_unknown_loop_stops_at_start_naming_the_setting() -> None:
    env = {"LLAMAMESH_GATEWAY_EVENT_LOOP": "gevent", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "services"], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode != 0
    assert "LLAMAMESH_GATEWAY_EVENT_LOOP" in done.stderr and "'gevent'" in done.stderr, done.stderr


def test_serving_heap_freezes_the_start_up_heap_and_collects_young_objects_less_often() -> None:
    """In a fresh process (the test runner's heap stays as it is)."""
    code = (
        "import gc; from llamamesh.loop import serving_heap, SERVING_GC_THRESHOLD as T\n"
        "before = gc.get_threshold()\n"
        "n = serving_heap()\n"
        "assert n > 1000 and gc.get_freeze_count() == n, n\n"
        "assert gc.get_threshold() == (T, *before[1:]) and T > before[0], gc.get_threshold()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.stdout.strip() == "ok", done.stderr


async def test_cancel_and_wait_ends_a_task_that_lost_a_cancellation() -> None:
    """A loop whose cancellation was lost inside a call (as a library may lose one that arrives with
    its reply) goes on to its next wait: it is cancelled again there, not waited out."""
    lost = asyncio.Event()

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)  # the call the cancellation arrives in
            except asyncio.CancelledError:
                if lost.is_set():
                    raise
                lost.set()  # lost once
            await asyncio.sleep(3600)  # the loop's interval

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # not a wait: the task reaches its first call
    await asyncio.wait_for(cancel_and_wait(task, None), 5)
    assert lost.is_set() and task.cancelled()


async def test_cancel_and_wait_returns_whatever_the_tasks_ended_with() -> None:
    async def fails() -> None:
        raise RuntimeError("its own")

    done = asyncio.create_task(asyncio.sleep(0))
    failed = asyncio.create_task(fails())
    await asyncio.wait({done, failed})
    await cancel_and_wait(done, failed, None, asyncio.create_task(asyncio.sleep(3600)))
    assert failed.exception() is not None and done.result() is None
