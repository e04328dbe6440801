"""Prefix affinity with two real worker processes (`python -m workers`, fake engine) on real Redis:
each prefix key's jobs run on its partition's owner; SIGKILL one, and its partitions move to the
other, its leased job is reclaimed once (it had begun: it goes on where its stream stood),
and its keys' next jobs run on the survivor."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import JobEvent
from tests.redisproc import RedisProcess
from tests.waiting import until
from tests.workers.test_affinity_workers import P, job, key_in, settled

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


class Pool:
    def __init__(self, server: RedisProcess, workdir: Path) -> None:
        self.prefix = f"aff:{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.prefix)
        self.settings = RedisSettings(url=server.url, prefix=self.prefix, affinity_partitions=P, block_ms=200)
        self.dir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {
            **os.environ,
            "LLAMAMESH_REDIS_URL": server.url,
            "LLAMAMESH_REDIS_PREFIX": self.prefix,
            "LLAMAMESH_REDIS_AFFINITY_PARTITIONS": str(P),
            # no steals here (a loaded machine can keep an owner from its job for 50 ms): each
            # key's jobs must run on its owner; test_affinity_workers covers stealing
            "LLAMAMESH_REDIS_AFFINITY_STEAL_AFTER_MS": "5000",
            "LLAMAMESH_WORKER_ENGINE": "fake",
            "LLAMAMESH_WORKER_POOL": "cpu",
            "LLAMAMESH_WORKER_MAX_INFLIGHT": "1",
            "LLAMAMESH_WORKER_FAKE_STEP_S": "0.05",
            "LLAMAMESH_WORKER_HEARTBEAT_S": "0.2",
            "LLAMAMESH_WORKER_HEARTBEAT_TTL_S": "1",
            # a blocking read ends within a heartbeat: see settled()
            "LLAMAMESH_REDIS_BLOCK_MS": "200",
            "LLAMAMESH_WORKER_CLAIM_IDLE_S": "1",
            "LLAMAMESH_LOG_FORMAT": "json",
        }

    def spawn(self, name: str) -> None:
        with (self.dir / f"{name}.log").open("ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "workers"],
                stdout=out,
                stderr=out,
                env={**self.env, "LLAMAMESH_WORKER_CONSUMER": name},
            )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
async def pool(redis_server: RedisProcess, tmp_path: Path) -> AsyncIterator[Pool]:
    p = Pool(redis_server, tmp_path)
    try:
        yield p
    finally:
        p.stop()


async def owners(r: aioredis.Redis, pool: Pool) -> dict[str, list[int]]:
    """worker -> the partitions it owns, as the owners hash says."""
    raw = await r.hgetall(pool.keys.owners("cpu"))
    out: dict[str, list[int]] = {}
    for f, v in raw.items():
        if not f.startswith(b"m:"):
            out.setdefault(v.decode().split()[0], []).append(int(f))
    return {w: sorted(ks) for w, ks in out.items()}


async def ran_on(q: RedisQueue, rid: str) -> tuple[set[str], JobEvent]:
    evs = [e async for _i, e in q.events(rid)]
    return {e.worker for e in evs if e.worker}, evs[-1]


async def test_two_worker_processes_keep_their_keys_and_a_killed_ones_share_moves(pool: Pool) -> None:
    r = aioredis.Redis.from_url(pool.settings.url)
    q = RedisQueue.from_settings(pool.settings)
    try:
        pool.spawn("w1")
        pool.spawn("w2")

        async def shared() -> bool:
            for name, p in pool.procs.items():
                assert p.poll() is None, (pool.dir / f"{name}.log").read_text()[-3000:]
            return sorted(len(v) for v in (await owners(r, pool)).values()) == [2, 2]

        await until(shared, 60, "both workers to own half the partitions")
        await settled(r, pool.keys.owners("cpu"))
        own = await owners(r, pool)
        keys = {w: key_in(own[w]) for w in ("w1", "w2")}
        for i in range(3):
            for w, key in keys.items():
                await q.submit("cpu", job(f"{w}-{i}", key))
                workers, last = await asyncio.wait_for(ran_on(q, f"{w}-{i}"), 10)
                assert workers == {w} and last.finished is not None
        # w1 runs a long job (100 steps of 50 ms) and dies with it leased
        await q.submit("cpu", job("long", keys["w1"], n=100))

        async def begun() -> bool:
            return len(await q.read_events("long")) > 0

        await until(begun, 10, "the long job to start on w1")
        pool.procs["w1"].send_signal(signal.SIGKILL)
        pool.procs["w1"].wait(10)

        async def moved() -> bool:
            return await owners(r, pool) == {"w2": list(range(P))}

        await until(moved, 10, "w2 to own every partition")
        # taken over once by w2 (claim idle 1 s): it had begun, so w2 goes on from where its stream
        # stood, never from the start
        workers, last = await asyncio.wait_for(ran_on(q, "long"), 15)
        assert last.finished is not None and last.finished.usage.completion_tokens == 100 and workers == {"w1", "w2"}
        evs = await q.read_events("long")
        assert sum(1 for _i, e in evs if e.terminal) == 1
        ranges = [(e.index, e.index + len(e.token_ids)) for _i, e in evs if e.token_ids]
        assert ranges[0][0] == 0 and ranges[-1][1] == 100  # every token once, in order
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges
        await q.submit("cpu", job("after", keys["w1"]))
        workers, last = await asyncio.wait_for(ran_on(q, "after"), 10)
        assert workers == {"w2"} and last.finished is not None
        pending = 0
        for k in range(P):
            pending += (await r.xpending(pool.keys.jobs_part("cpu", "", k), WORKER_GROUP))["pending"]
        assert pending == 0
    finally:
        await q.close()
        await r.aclose()
