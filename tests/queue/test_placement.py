"""Balanced placement of prefix keys (affinity on, LLAMAMESH_REDIS_AFFINITY_PLACEMENT=balanced): a
new key goes to the ready worker with the fewest keys placed, then keeps its partition while it is
used; keys unused for the ttl are forgotten, and a pool remembers a bounded number. On Redis, Valkey
and a Redis Cluster (submit.lua) and on the fake (affinity.Placements), which must agree."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llamamesh.queue import affinity
from llamamesh.queue.affinity import Placements, least_loaded, partition_of, placement_field
from llamamesh.queue.memory import MemoryQueue
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from tests.queue.test_affinity import P, job, key_in, settings_with, share
from tests.waiting import until

pytestmark = [pytest.mark.timeout(30)]

# Ownership outlives every test here: a slow machine never sees an owner's lease run out midway.
LONG_S = 60.0


def balanced(base: RedisSettings, ttl_s: float = 600.0) -> RedisSettings:
    return dataclasses.replace(
        settings_with(base, steal_after_ms=60_000), affinity_placement="balanced", affinity_placement_ttl_s=ttl_s
    )


@pytest.fixture(params=["redis", "memory"])
async def queue(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryQueue(partitions=P, steal_after_ms=60_000, placement="balanced")
        return
    q = RedisQueue.from_settings(balanced(redis_settings))
    await q.join("cpu")
    yield q
    await q.close()


async def placed(q: Any, rids: list[str]) -> dict[str, tuple[str, int]]:
    """request id -> (the worker that leased it, its partition): each worker leases its own only."""
    out: dict[str, tuple[str, int]] = {}
    for worker in ("w1", "w2"):
        for lease in await q.lease("cpu", worker, 100, 0):
            assert lease.partition is not None and not lease.stolen
            out[lease.request.request_id] = (worker, lease.partition)
    assert sorted(out) == sorted(rids)
    return out


# ---- without Redis ------------------------------------------------------------


def test_a_new_key_goes_to_the_owner_with_the_fewest_keys_then_its_emptiest_partition() -> None:
    owners = {0: ("a", 10**9), 1: ("a", 10**9), 2: ("b", 10**9), 3: ("b", 10**9)}
    assert least_loaded(1, 4, {}, owners, 0) == 1  # all equal: where it hashes
    assert least_loaded(0, 4, {0: 1}, owners, 0) == 2  # a has one: b's first from 0 on
    assert least_loaded(0, 4, {0: 1, 2: 1}, owners, 0) == 1  # even owners: the emptiest partition
    expired = {**owners, 2: ("b", 5), 3: ("b", 5)}  # b's lease is over: nobody's, counted apart
    assert least_loaded(0, 4, {0: 2, 1: 2, 2: 3}, expired, 10) == 3


def test_placements_spread_keys_evenly_and_keep_each_where_it_was_put() -> None:
    owners = {k: ("a" if k < 8 else "b", 10**9) for k in range(16)}
    p = Placements(ttl_ms=1000)
    first = {
        f"conv-{i}": p.place(f"conv-{i}", partition_of(job("x", f"conv-{i}"), 16), 16, owners, 0) for i in range(64)
    }
    per_owner = Counter(owners[k][0] for k in first.values())
    assert per_owner == {"a": 32, "b": 32} and set(Counter(first.values()).values()) == {4}
    again = {key: p.place(key, 0, 16, owners, 500) for key in first}
    assert again == first


def test_a_key_unused_for_the_ttl_is_forgotten_and_placed_anew() -> None:
    owners = {0: ("a", 10**9), 1: ("b", 10**9)}
    p = Placements(ttl_ms=100)
    assert p.place("k1", 0, 2, owners, 0) == 0
    assert p.place("k2", 0, 2, owners, 50) == 1
    assert p.place("k3", 0, 2, owners, 149) == 0  # k1 (unused since 0) is forgotten first: a is empty
    assert p.where == {"k2": 1, "k3": 0} and p.load == {0: 1, 1: 1}


def test_past_the_most_keys_the_least_recently_used_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "MOST_PLACED", 3)
    p = Placements(ttl_ms=10**9)
    for n, key in enumerate(["a", "b", "c", "a", "d"]):
        p.place(key, 0, 4, {}, n)
    assert list(p.used) == ["c", "a", "d"] and sum(p.load.values()) == 3


# ---- both ---------------------------------------------------------------------


@pytest.mark.redis
async def test_keys_that_hash_to_one_worker_are_shared_out_between_both(queue: Any) -> None:
    await share(queue, ttl_s=LONG_S)
    keys = [key_in(queue.owned("cpu", "w1")) + f"-{i}" for i in range(200)]
    keys = [k for k in keys if partition_of(job("x", k), P) in queue.owned("cpu", "w1")][:8]
    for i, key in enumerate(keys):
        await queue.submit("cpu", job(f"r{i}", key))
    where = await placed(queue, [f"r{i}" for i in range(8)])
    assert Counter(w for w, _k in where.values()) == {"w1": 4, "w2": 4}
    assert set(Counter(k for _w, k in where.values()).values()) == {2}
    # each key's later requests go where its first went, whatever its hash says
    for i, key in enumerate(keys):
        await queue.submit("cpu", job(f"again{i}", key))
    again = await placed(queue, [f"again{i}" for i in range(8)])
    assert [again[f"again{i}"] for i in range(8)] == [where[f"r{i}"] for i in range(8)]


@pytest.mark.redis
async def test_each_tenants_keys_are_placed_apart(queue: Any) -> None:
    await share(queue, ttl_s=LONG_S)
    key = key_in(queue.owned("cpu", "w1"))
    await queue.submit("cpu", dataclasses.replace(job("a", key), tenant="t1"))
    await queue.submit("cpu", dataclasses.replace(job("b", key), tenant="t2"))
    await queue.submit("cpu", job("c", key))
    where = await placed(queue, ["a", "b", "c"])
    # three keys: the first where it hashes (w1), the second on w2, the third on w1 again
    assert [where[r][0] for r in ("a", "b", "c")] == ["w1", "w2", "w1"]


@pytest.mark.redis
async def test_redis_and_the_fake_place_a_sequence_of_keys_alike(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(balanced(redis_settings))
    fake = MemoryQueue(partitions=P, steal_after_ms=60_000, placement="balanced")
    try:
        await q.join("cpu")
        got = []
        for side in (q, fake):
            await share(side, ttl_s=LONG_S)
            rids = []
            for i, key in enumerate(f"k{n % 11}" for n in range(40)):
                rids.append(f"r{i}")
                await side.submit("cpu", job(f"r{i}", key))
            where = await placed(side, rids)
            got.append([where[r] for r in rids])
        assert got[0] == got[1]
    finally:
        await q.close()


@pytest.mark.redis
async def test_a_forgotten_key_is_placed_again_on_redis(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(balanced(redis_settings, ttl_s=0.05))
    try:
        await q.join("cpu")
        await share(q, ttl_s=LONG_S)
        key = key_in(q.owned("cpu", "w1"))
        await q.submit("cpu", job("first", key))
        assert (await placed(q, ["first"]))["first"][0] == "w1"
        keys = q.keys
        assert await q.client.hlen(keys.placements("cpu")) == 1
        # unused past the ttl (Redis's clock): the next submission of any key forgets it
        used = await q.client.zscore(keys.placements_used("cpu"), placement_field("", key))
        assert used is not None

        async def redis_ms() -> int:
            secs, micros = await q.client.time()
            return secs * 1000 + micros // 1000

        await until(redis_ms, 5, "the key's ttl to pass", done=lambda now: now > used + 50)
        await q.submit("cpu", job("other", key + "-other"))
        assert await q.client.hlen(keys.placements("cpu")) == 1
        assert await q.client.zcard(keys.placements_used("cpu")) == 1
        load = {int(k): int(v) for k, v in (await q.client.hgetall(keys.placements_load("cpu"))).items()}
        assert sum(load.values()) == 1
    finally:
        await q.close()
