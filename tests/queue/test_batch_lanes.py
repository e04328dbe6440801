"""The order workers lease batch items in: the batch whose deadline comes first first (equal
deadlines: the batch submitted first), each prefix group from the worker that leased its first item;
each batch's lane is deleted once it ended, and items of the pool's shared stream are still leased.
On Redis, Valkey and a Redis Cluster (RedisBatches), and in memory (MemoryBatches)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from llamamesh.queue import codec, intake
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, lane_member
from llamamesh.queue.lanes import BatchLanes
from llamamesh.queue.memory import MemoryBatches
from llamamesh.queue.protocol import BatchStore, Lease
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import BatchInfo, BatchState, ItemResult, ItemStatus
from tests.queue.jobs import batch
from tests.waiting import until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


def ok(lease: Lease) -> ItemResult:
    return ItemResult(lease.request.custom_id, ItemStatus.SUCCEEDED, "text")


def ids(leases: list[Lease]) -> list[str]:
    return [f"{x.request.batch_id}/{x.request.custom_id}" for x in leases]


async def test_the_batch_due_first_is_leased_first_though_submitted_later(store: BatchStore) -> None:
    for bid, window in (("relaxed", 3600), ("urgent", 60), ("middle", 600)):
        info, items = batch(bid, 2, window_s=window)
        await store.create(info, "fp", items)
    first = await store.lease_items("cpu", "w", 3, None)
    assert ids(first) == ["urgent/c0", "urgent/c1", "middle/c0"]
    info, items = batch("sooner", 1, window_s=30)  # a later batch due sooner still goes ahead
    await store.create(info, "fp", items)
    rest = await store.lease_items("cpu", "w", 10, None)
    assert ids(rest) == ["sooner/c0", "middle/c1", "relaxed/c0", "relaxed/c1"]


async def test_batches_due_at_once_are_leased_in_submission_order(store: BatchStore) -> None:
    due = batch("any", 1)[0].expires_at
    for n, bid in enumerate(("zz-first", "aa-second", "mm-third")):
        info, items = batch(bid, 2)
        info = dataclasses.replace(info, created_at=info.created_at + n, expires_at=due)
        await store.create(info, "fp", items)
    got = await store.lease_items("cpu", "w", 10, None)
    assert [x.request.batch_id for x in got] == ["zz-first"] * 2 + ["aa-second"] * 2 + ["mm-third"] * 2


def prefixed(bid: str, keys: list[str]) -> tuple[BatchInfo, list]:
    """A batch whose item ``i`` has prefix key ``keys[i]``."""
    info, items = batch(bid, len(keys))
    return info, [(p, dataclasses.replace(r, prefix_key=k)) for (p, r), k in zip(items, keys, strict=True)]


async def filler(store: BatchStore, n: int = 40) -> None:
    """A batch due after every other one: the work a worker takes while a group is held for another."""
    info, items = batch("filler", n, window_s=86400)
    await store.create(info, "fp", items)


async def test_each_prefix_groups_items_go_to_one_worker(store: BatchStore) -> None:
    """Three prefix keys interleaved, leased two at a time by two workers in turn, with another
    batch's items for whoever finds a group held for the other: every key's items all go to one
    worker (each group is leased well within the hold). The worker that leased a group's first item
    (a's third lease ends with p1's first) keeps the group; one whose lease ends with a group's last
    item leaves the next group to whoever comes first (b, for p2)."""
    info, items = prefixed("g", [f"p{i % 3}" for i in range(15)])
    await store.create(info, "fp", items)
    await filler(store)
    owner: dict[str, set[str]] = {}
    taken = 0
    for turn in range(30):
        worker = "ab"[turn % 2]
        for x in await store.lease_items("cpu", worker, 2, None):
            if x.request.batch_id == "g":
                owner.setdefault(x.request.prefix_key, set()).add(worker)
                taken += 1
    assert taken == 15 and owner == {"p0": {"a"}, "p1": {"a"}, "p2": {"b"}}


async def test_a_worker_with_nothing_else_takes_over_a_held_group(store: BatchStore) -> None:
    """No worker waits while items do: with no other lane to lease from, b takes of the group held
    for a, and the rest of that group is anyone's from then on."""
    info, items = prefixed("solo", ["k"] * 6)
    await store.create(info, "fp", items)
    assert [x.request.custom_id for x in await store.lease_items("cpu", "a", 2, None)] == ["c0", "c1"]
    assert [x.request.custom_id for x in await store.lease_items("cpu", "b", 2, None)] == ["c2", "c3"]
    await filler(store)  # now there is other work, but the group is held for nobody any more
    assert [x.request.custom_id for x in await store.lease_items("cpu", "a", 1, None)] == ["c4"]
    assert [x.request.custom_id for x in await store.lease_items("cpu", "b", 1, None)] == ["c5"]


async def test_a_group_held_for_a_worker_that_does_not_come_back_goes_to_any_worker(
    redis_settings: RedisSettings,
) -> None:
    """The rest of a group waits for the worker that took its first item only a while; then every
    worker takes of it (no second hold): a group larger than one worker's slots is never stuck."""
    q = RedisQueue.from_settings(redis_settings)
    for store in (RedisBatches(q.client, q.keys, retention_s=60, prefix_hold_ms=300), MemoryBatches(hold_ms=300)):
        info, items = prefixed("held", ["k"] * 8)
        await store.create(info, "fp", items)
        await filler(store, 200)
        assert len(await store.lease_items("cpu", "a", 2, None)) == 2  # then a is full: it leases no more
        # the rest waits for a, a while: b takes the other batch's items meanwhile
        assert {x.request.batch_id for x in await store.lease_items("cpu", "b", 2, None)} == {"filler"}
        more = await until(
            functools.partial(store.lease_items, "cpu", "b", 2, None),
            5,
            "b to get more of the group",
            done=lambda got: any(x.request.batch_id == "held" for x in got),
        )
        assert [x.request.custom_id for x in more] == ["c2", "c3"]
        assert [x.request.custom_id for x in await store.lease_items("cpu", "a", 2, None)] == ["c4", "c5"]
        rest = await store.lease_items("cpu", "b", 5, None)
        assert [x.request.custom_id for x in rest if x.request.batch_id == "held"] == ["c6", "c7"]
    await q.close()


async def test_a_lane_goes_once_its_batch_ended(redis_settings: RedisSettings) -> None:
    """Completed, cancelled, expired: the lane, its listings and its hold are gone."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=30)
    memory = MemoryBatches()
    k = q.keys
    try:
        for s in (store, memory):
            for bid in ("done", "off", "kept"):
                info, items = prefixed(bid, ["k", "k"])
                await s.create(info, "fp", items)
            for x in await s.lease_items("cpu", "w", 3, None):  # done's two, off's first
                if x.request.batch_id == "done":
                    await s.record(x, ok(x))
            await s.cancel("off")  # its first item runs on
            info, items = prefixed("late", ["k", "k"])
            await s.create(dataclasses.replace(info, expires_at=info.created_at - 1), "fp", items)
            await s.sweep()  # late: its window is over
            assert [await state(s, b) for b in ("done", "off", "late")] == [
                BatchState.COMPLETED,
                BatchState.CANCELLING,
                BatchState.EXPIRED,
            ]
        off = await q.client.xrange(k.batch_lane("cpu", "off"))
        assert len(off) == 2  # its running item's lane stays until its result
        lanes = await q.client.zrange(k.batch_lanes_open("cpu"), 0, -1)
        assert [m.decode().partition(":")[2] for m in lanes] == ["off", "kept"]
        for bid in ("done", "late"):
            assert not await q.client.exists(k.batch_lane("cpu", bid))
        assert memory.lanes.lanes("cpu") == ["off", "kept"]

        (running,) = await running_of(store, q, "off")
        await store.record(running, ok(running))
        assert await state(store, "off") is BatchState.CANCELLED
        assert not await q.client.exists(k.batch_lane("cpu", "off"))
        assert await q.client.zrange(k.batch_lanes_open("cpu"), 0, -1) == [lane_member_of(await store.get("kept"))]
        assert await q.client.zrange(k.batch_lanes("cpu"), 0, -1) == [lane_member_of(await store.get("kept"))]
        assert await q.client.hkeys(k.batch_holds("cpu")) == []
    finally:
        await q.close()


async def test_a_batch_cancelled_while_its_submission_writes_leaves_no_lane(
    redis_settings: RedisSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel deletes the lane after the first item; the second, queued after it, lists the
    lane again: the submission deletes it once it sees the batch ended."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=30)
    k = q.keys
    monkeypatch.setattr(intake, "CHUNK_ITEMS", 1)
    queue_chunk = store.intake._queue_chunk
    chunks = 0

    async def cancelled_after_the_first(*args: object) -> None:
        nonlocal chunks
        await queue_chunk(*args)  # type: ignore[arg-type]
        chunks += 1
        if chunks == 1:
            await store.cancel("torn")
            assert not await q.client.exists(k.batch_lane("cpu", "torn"))

    monkeypatch.setattr(store.intake, "_queue_chunk", cancelled_after_the_first)
    try:
        info, items = prefixed("torn", ["k", "j"])
        await store.create(info, "fp", items)
        assert chunks == 2
        assert await state(store, "torn") is BatchState.CANCELLED
        assert await store.lease_items("cpu", "w", 5, None) == []
        assert not await q.client.exists(k.batch_lane("cpu", "torn"))
        assert await q.client.zrange(k.batch_lanes_open("cpu"), 0, -1) == []
        assert await q.client.zrange(k.batch_lanes("cpu"), 0, -1) == []
    finally:
        await q.close()


async def state(store: BatchStore, batch_id: str) -> BatchState:
    info = await store.get(batch_id)
    assert info is not None
    return info.state


def lane_member_of(info: BatchInfo | None) -> bytes:
    assert info is not None
    return lane_member(info.created_at, info.batch_id).encode()


async def running_of(store: RedisBatches, q: RedisQueue, bid: str) -> list[Lease]:
    """The leased items of a batch's lane, taken over by "heir" (XCLAIM them at once)."""
    pending = await q.client.xpending_range(q.keys.batch_lane("cpu", bid), WORKER_GROUP, "-", "+", 10)
    assert len(pending) == 1
    return await store.reclaim("cpu", "heir", 0, 10)


async def test_a_dead_workers_items_are_reclaimed_from_every_lane(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.2)
    try:
        for bid in ("one", "two", "three"):
            info, items = batch(bid, 2)
            await store.create(info, "fp", items)
        dead = await store.lease_items("cpu", "dead", 4, None)  # one's and two's
        live = await store.lease_items("cpu", "live", 2, None)  # three's: its worker touches them
        assert ids(live) == ["three/c0", "three/c1"]
        got: list[Lease] = []

        async def heir_claims() -> list[Lease]:
            await store.touch("cpu", "live", [x.item_ref for x in live])
            got.extend(await store.reclaim("cpu", "heir", 200, 10))
            return got

        await until(heir_claims, 5, "the heir to claim the dead worker's items", done=lambda g: len(g) >= 4)
        assert sorted(ids(got)) == sorted(ids(dead))
        for x in got:
            assert await store.record(x, ok(x))
        assert [await state(store, b) for b in ("one", "two", "three")] == [
            BatchState.COMPLETED,
            BatchState.COMPLETED,
            BatchState.IN_PROGRESS,
        ]
    finally:
        await q.close()


async def test_a_touch_never_takes_back_an_item_another_worker_took_over(redis_settings: RedisSettings) -> None:
    """A worker that could not touch its items for the claim idle time (paused) lost them to another:
    its next touch leaves them with that one and names them (the worker stops them), and still
    touches those it holds."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.2)
    try:
        for bid in ("one", "two"):
            info, items = batch(bid, 1)
            await store.create(info, "fp", items)
        lanes = BatchLanes(q.client, q.keys)
        held = await store.lease_items("cpu", "paused", 2, None)
        lost = held[0]
        await q.client.xclaim(lanes.stream("cpu", lost.request.batch_id), WORKER_GROUP, "heir", 0, [lost.entry_id])
        assert await store.touch("cpu", "paused", [x.item_ref for x in held]) == [lost.item_ref]
        for x in held:
            stream = lanes.stream("cpu", x.request.batch_id)
            (row,) = await q.client.xpending_range(stream, WORKER_GROUP, "-", "+", 10)
            assert row["consumer"].decode() == ("heir" if x is lost else "paused")
            assert int(row["time_since_delivered"]) < 1000
    finally:
        await q.close()


async def test_items_of_the_pools_shared_stream_are_still_leased_and_recorded(redis_settings: RedisSettings) -> None:
    """Items queued on the pool's one batch stream (as gateways did before lanes) are leased ahead
    of the lanes, touched, reclaimed and recorded there, and acked off it."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.2)
    shared, k = q.keys.batch_items("cpu"), q.keys
    try:
        info, items = batch("old", 3)
        await store.create(info, "fp", items)  # its record (and its lane, emptied here)
        await q.client.delete(k.batch_lane("cpu", "old"))
        await q.client.xgroup_create(shared, WORKER_GROUP, id="0", mkstream=True)
        for _pool, req in items:
            await q.client.xadd(shared, {JOB_FIELD: codec.encode_job(req)})
        new_info, new_items = batch("new", 1, window_s=1)  # due sooner, yet after the shared stream
        await store.create(new_info, "fp", new_items)

        leased = await store.lease_items("cpu", "dead", 2, None)
        assert ids(leased) == ["old/c0", "old/c1"] and all(x.shared for x in leased)
        rest = await store.lease_items("cpu", "w", 5, None)
        assert ids(rest) == ["old/c2", "new/c0"] and [x.shared for x in rest] == [True, False]
        got: list[Lease] = []

        async def heir_claims() -> list[Lease]:
            await store.touch("cpu", "w", [x.item_ref for x in rest])  # w lives on
            got.extend(await store.reclaim("cpu", "heir", 200, 10))
            return got

        await until(heir_claims, 5, "the heir to claim old's c0 and c1")
        assert ids(got) == ["old/c0", "old/c1"] and all(x.shared for x in got)
        for x in [*got, *rest]:
            assert await store.record(x, ok(x))
        assert [await state(store, b) for b in ("old", "new")] == [BatchState.COMPLETED] * 2
        assert await q.client.xlen(shared) == 0 and (await q.client.xpending(shared, WORKER_GROUP))["pending"] == 0
    finally:
        await q.close()


async def test_pruning_goes_round_the_open_lanes_a_window_at_a_time(redis_settings: RedisSettings) -> None:
    """A worker gone from 40 open lanes: each prune looks at 32 of them at most, the next at the
    rest, so what one prune costs stays bounded however many batches are open."""
    q = RedisQueue.from_settings(dataclasses.replace(redis_settings, consumer_idle_s=1))
    store = RedisBatches(q.client, q.keys, retention_s=60)
    try:
        for n in range(40):
            info, items = batch(f"open-{n:02d}", 1)
            await store.create(info, "fp", items)
            (lease,) = await store.lease_items("cpu", "gone", 1, None)
            await store.discard(lease)  # "gone" holds nothing in the lane, which stays open
        last = q.keys.batch_lane("cpu", "open-39")

        async def idle_ms() -> int:
            return min(int(c["idle"]) for c in await q.client.xinfo_consumers(last, WORKER_GROUP))

        await until(idle_ms, 10, "the last lane's consumer idle for the server's 1 s", done=lambda ms: ms >= 1000)
        assert await q.prune_consumers("cpu") == 32
        assert await q.prune_consumers("cpu") == 8
        assert await q.prune_consumers("cpu") == 0
    finally:
        await q.close()
