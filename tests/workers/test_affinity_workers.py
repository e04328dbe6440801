"""Prefix affinity with two real Workers (fake engine) on real Redis: a prefix key's jobs run on the
worker that owns its partition while it has room; a busy owner's queued job runs on the idle one;
with balanced placement, keys that all hash to one worker's partitions are shared out between both."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.affinity import partition_of
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings, WorkerSettings
from llamamesh.types import GenerationRequest, JobEvent, SamplingParams
from tests.waiting import until
from workers.engines.fake import FakeEngine
from workers.worker import Worker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

P = 4
# the tests of where a job runs: no loaded machine keeps an idle owner from its job this long, so an
# idle worker never steals it first
NO_STEALS = {"affinity_steal_after_ms": 10_000}
# the test of steals: a busy owner's queued job is stolen well within the test
STEALS = {"affinity_steal_after_ms": 500}


def job(rid: str, key: str, n: int = 2) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model="m", prompt="p", sampling=SamplingParams(max_tokens=n), prefix_key=key
    )


def key_in(partitions: list[int]) -> str:
    return next(k for i in itertools.count() if partition_of(job("x", k := f"conv-{i}"), P) in partitions)


async def settled(client: aioredis.Redis, owners_key: str, beats: int = 5) -> None:
    """Once the partitions are shared out, until every worker heartbeats ``beats`` more times with
    none of them moving: a blocking read that a worker began before it gave a partition back still
    covers it, and Redis serves the reader that blocked first, so a job sent at once could go to the
    old owner; by then every such read has timed out (the workers here block for less than that)."""
    owners: dict[bytes, bytes] = {}
    beat: dict[bytes, set[bytes]] = {}

    async def quiet() -> bool:
        raw = await client.hgetall(owners_key)
        now = {f: v.split()[0] for f, v in raw.items() if not f.startswith(b"m:")}
        if now != owners:
            owners.clear()
            owners.update(now)
            beat.clear()
        for f, v in raw.items():
            if f.startswith(b"m:"):
                beat.setdefault(f, set()).add(v)
        return bool(beat) and all(len(b) > beats for b in beat.values())

    await until(quiet, 30, f"{beats} heartbeats of every worker with no partition moving")


async def finished(q: RedisQueue, rid: str) -> list[JobEvent]:
    out = []
    async for _i, e in q.events(rid):
        out.append(e)
    assert out[-1].finished is not None
    return out


@dataclasses.dataclass
class Pool:
    queue: RedisQueue  # the gateway's
    workers: dict[str, tuple[Worker, FakeEngine, RedisQueue]]


@pytest.fixture
async def pool(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[Pool]:
    """Two workers: w1 (one slot) and w2 (four), with the Redis settings ``request.param``."""
    settings = dataclasses.replace(redis_settings, affinity_partitions=P, **getattr(request, "param", NO_STEALS))
    gateway = RedisQueue.from_settings(settings)
    started: dict[str, tuple[Worker, FakeEngine, RedisQueue]] = {}
    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = []
    for name, slots in (("w1", 1), ("w2", 4)):  # w1 has one slot: it is busy with one job
        ws = WorkerSettings(
            pool="cpu", engine="fake", max_inflight=slots, fake_step_s=0.05, consumer=name, heartbeat_s=0.1
        )
        q = RedisQueue.from_settings(settings)
        engine = FakeEngine(ws)
        await engine.start()
        worker = Worker(ws, q, engine, block_ms=200)
        stop = asyncio.Event()
        stops.append((stop, asyncio.create_task(worker.run(stop))))
        await asyncio.wait_for(worker.ready.wait(), 5)
        started[name] = (worker, engine, q)
    try:
        shares = lambda: sorted(len(q.owned("cpu", n)) for n, (_w, _e, q) in started.items())  # noqa: E731
        await until(shares, 10, "the two workers' equal shares (a few heartbeats)", done=lambda got: got == [2, 2])
        await settled(gateway.client, gateway.keys.owners("cpu"))
        yield Pool(gateway, started)
    finally:
        for stop, task in stops:
            stop.set()
            await asyncio.wait_for(task, 10)
        for _w, engine, q in started.values():
            await engine.shutdown()
            await q.close()
        await gateway.close()


async def test_a_prefix_keys_jobs_run_on_its_owner_while_it_has_room(pool: Pool) -> None:
    keys = {name: key_in(q.owned("cpu", name)) for name, (_w, _e, q) in pool.workers.items()}
    for i in range(4):
        for name, key in keys.items():
            await pool.queue.submit("cpu", job(f"{name}-{i}", key))
            evs = await asyncio.wait_for(finished(pool.queue, f"{name}-{i}"), 10)
            assert {e.worker for e in evs if e.worker} == {name}
    for name, (_w, engine, _q) in pool.workers.items():
        assert sorted(engine.served) == [f"{name}-{i}" for i in range(4)]


@pytest.mark.parametrize("pool", [STEALS], indirect=True, ids=["steals"])
async def test_a_busy_owners_queued_job_runs_on_the_idle_worker(pool: Pool) -> None:
    _w1, e1, q1 = pool.workers["w1"]
    key = key_in(q1.owned("cpu", "w1"))
    await pool.queue.submit("cpu", job("long", key, n=100))  # 100 steps of 50 ms on w1's one slot
    await until(lambda: "long" in e1.served, 10, "the long job to start on w1")
    await pool.queue.submit("cpu", job("next", key))
    evs = await asyncio.wait_for(finished(pool.queue, "next"), 5)
    assert {e.worker for e in evs if e.worker} == {"w2"}  # stolen: it did not wait for the long one
    long = await asyncio.wait_for(finished(pool.queue, "long"), 15)
    assert {e.worker for e in long if e.worker} == {"w1"}


@pytest.mark.parametrize("pool", [NO_STEALS | {"affinity_placement": "balanced"}], indirect=True, ids=["balanced"])
async def test_balanced_placement_shares_keys_that_hash_to_one_worker_between_both(pool: Pool) -> None:
    _w1, _e1, q1 = pool.workers["w1"]
    mine = q1.owned("cpu", "w1")
    keys = [k for k in (f"conv-{i}" for i in range(400)) if partition_of(job("x", k), P) in mine][:8]
    ran: dict[str, str] = {}
    for turn in range(2):
        for key in keys:
            rid = f"{key}-{turn}"
            await pool.queue.submit("cpu", job(rid, key))
            evs = await asyncio.wait_for(finished(pool.queue, rid), 10)
            (worker,) = {e.worker for e in evs if e.worker}
            assert ran.setdefault(key, worker) == worker  # a key's turns stay where its first went
    assert sorted(ran.values()) == ["w1"] * 4 + ["w2"] * 4
