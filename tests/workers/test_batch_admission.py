"""Adaptive batch admission in a worker against a real Redis, with the fake engine: batch items
take the ceiling while nothing interactive runs, give their slots back down to the floor while
interactive requests miss their first-token target, take them back once those stop, and every item
still ends with one result; static admission keeps the ceiling throughout."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import BatchSettings, RedisSettings, WorkerSettings
from llamamesh.types import BatchState, GenerationRequest, SamplingParams
from tests.queue.jobs import batch
from tests.waiting import until
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]

SLOTS = 20  # ceiling 10 (max_share 0.5), floor 2 (min_share 0.1)


@dataclass
class Node:
    worker: Worker
    queue: RedisQueue
    store: RedisBatches


@pytest.fixture
async def node(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[Node]:
    queue = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(queue.client, queue.keys, retention_s=60, claim_idle_s=5)
    ws = WorkerSettings(pool="cpu", engine="fake", max_inflight=SLOTS, fake_step_s=0.01, consumer="w-admit")
    admission = BatchSettings(
        admission=request.param,
        max_share=0.5,
        min_share=0.1,
        interactive_ttft_target_s=0.001,  # missed by every interactive request: batch items yield
        adapt_interval_s=0.2,
        claim_idle_s=5,
    )
    engine = FakeEngine(ws)
    await engine.start()
    worker = Worker(ws, queue, engine, block_ms=100, batches=store, batch=admission)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 5)
        yield Node(worker, queue, store)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await engine.shutdown()
        await queue.close()


async def interactive_load(queue: RedisQueue, stop: asyncio.Event, ran: list[str] | None = None) -> int:
    """Four interactive requests at a time until ``stop`` (each one's id in ``ran`` once ended);
    how many ran."""
    done = 0
    ran = [] if ran is None else ran

    async def one(i: int) -> None:
        req = GenerationRequest(
            request_id=f"i{i}",
            model="m",
            prompt=f"interactive {i}",
            sampling=SamplingParams(max_tokens=5),
            accepted_unix_ns=time.time_ns(),
        )
        await queue.submit("cpu", req)
        async for _i, ev in queue.events(req.request_id):
            if ev.terminal:
                ran.append(req.request_id)
                return

    while not stop.is_set():
        await asyncio.gather(*(one(done + k) for k in range(4)))
        done += 4
    return done


def allowance_gauge() -> float | None:
    return REGISTRY.get_sample_value("llamamesh_worker_batch_allowance_slots", {"pool": "cpu"})


@pytest.mark.parametrize("node", ["adaptive"], indirect=True)
async def test_batch_items_yield_to_interactive_requests_that_miss_the_target_and_come_back(node: Node) -> None:
    w = node.worker
    info, items = batch("yield", 400, max_tokens=20)
    await node.store.create(info, "fp", items)
    grown = "the batch alone to grow to the ceiling"
    await until(lambda: w.allowance.value == 10 and len(w.jobs.batch_running) >= 9, 20, grown)
    assert allowance_gauge() == 10
    stop = asyncio.Event()
    load = asyncio.create_task(interactive_load(node.queue, stop))
    try:
        await until(lambda: w.allowance.value == 2, 10, "the allowance to fall to the floor")
        assert allowance_gauge() == 2  # no await since: the gauge as the allowance was judged
        await until(lambda: len(w.jobs.batch_running) <= 2, 10, "running batch items to drain to the floor")
        assert w.allowance.signal_s is not None and w.allowance.signal_s > 0.001
    finally:
        stop.set()
        assert await asyncio.wait_for(load, 20) > 0
    await until(lambda: w.allowance.value == 10, 20, "the allowance back at the ceiling")
    final = await until(lambda: node.store.get("yield"), 60, "the batch to complete", done=_completed)
    assert final.succeeded == 400 and final.errored == 0


@pytest.mark.parametrize("node", ["static"], indirect=True)
async def test_static_admission_keeps_the_ceiling_under_interactive_load(node: Node) -> None:
    w = node.worker
    info, items = batch("static", 200, max_tokens=20)
    await node.store.create(info, "fp", items)
    await until(lambda: len(w.jobs.batch_running) >= 9, 20, "the batch at the ceiling")
    stop = asyncio.Event()
    ran: list[str] = []
    load = asyncio.create_task(interactive_load(node.queue, stop, ran))
    seen: list[int] = []
    try:
        await until(lambda: seen.append(len(w.jobs.batch_running)) or len(ran) >= 40, 30, "40 interactive requests")
        assert w.allowance.value == 10 and max(seen) >= 9
    finally:
        stop.set()
        assert await asyncio.wait_for(load, 20) > 0
    final = await until(lambda: node.store.get("static"), 60, "the batch to complete", done=_completed)
    assert final.succeeded == 200


def _completed(info: object) -> bool:
    return getattr(info, "state", None) is BatchState.COMPLETED
