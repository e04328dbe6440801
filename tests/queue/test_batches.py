"""The batch store contract, on Redis and Valkey (RedisBatches) and in memory (MemoryBatches)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import redis

from llamamesh.errors import AlreadyExists, QueueUnavailable
from llamamesh.queue import groups
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.files import RedisFiles
from llamamesh.queue.memory import MemoryBatches
from llamamesh.queue.protocol import BatchStore, Lease
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import (
    BatchInfo,
    BatchState,
    FinishReason,
    ItemResult,
    ItemStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tests.queue.jobs import batch

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


def ok(cid: str) -> ItemResult:
    return ItemResult(cid, ItemStatus.SUCCEEDED, "text", usage=Usage(7, 3, 2))


async def test_submit_is_idempotent_and_atomic(store: BatchStore) -> None:
    info, items = batch("b", 3)
    await store.join("cpu")
    made = await asyncio.gather(*(store.create(info, "fp", items) for _ in range(4)))  # concurrent retries
    assert [new for _b, new in made].count(True) == 1
    assert {b.batch_id for b, _new in made} == {"b"} and made[0][0].state is BatchState.IN_PROGRESS
    with pytest.raises(AlreadyExists, match="'b' names another batch"):
        await store.create(info, "another", items)
    assert [b.batch_id for b in await store.owned("t", 10, None)] == ["b"]
    assert await store.owned("someone-else", 10, None) == []


async def test_one_result_per_custom_id_and_the_last_one_ends_the_batch(store: BatchStore) -> None:
    info, items = batch("r", 2)
    await store.join("cpu")
    await store.create(info, "fp", items)
    leases = await store.lease_items("cpu", "w", 10, 100)
    assert sorted(x.request.custom_id for x in leases) == ["c0", "c1"]
    assert await store.record(leases[0], ok(leases[0].request.custom_id)) is True
    assert await store.record(leases[0], ok(leases[0].request.custom_id)) is False  # a second run: dropped
    mid = await store.get("r")
    assert mid is not None and mid.succeeded == 1 and mid.processing == 1 and mid.state is BatchState.IN_PROGRESS
    assert (mid.prompt_tokens, mid.completion_tokens) == (7, 3)  # the dropped second result counts nothing
    errored = ItemResult(leases[1].request.custom_id, ItemStatus.ERRORED, error_code="x", usage=Usage(5, 1))
    await store.record(leases[1], errored)
    end = await store.get("r")
    assert end is not None and end.state is BatchState.COMPLETED and (end.succeeded, end.errored) == (1, 1)
    assert (end.prompt_tokens, end.completion_tokens, end.cached_tokens) == (12, 4, 2)
    assert {"in_progress", "finalizing", "completed"} <= set(end.times)
    got = await store.results("r", "0-0", None)
    assert [r.custom_id for _c, r in got] == [leases[0].request.custom_id, leases[1].request.custom_id]
    assert [r.custom_id for _c, r in await store.results("r", got[0][0], None)] == [leases[1].request.custom_id]


async def test_a_result_keeps_each_samples_logprobs(store: BatchStore) -> None:
    info, items = batch("lp", 2)
    await store.join("cpu")
    await store.create(info, "fp", items)
    a, b = await store.lease_items("cpu", "w", 10, 100)
    lp = (TokenLogprob(5, -0.25, (TopLogprob(5, -0.25), TopLogprob(9, -1.5))), TokenLogprob(6, -0.75))
    one = ItemResult(a.request.custom_id, ItemStatus.SUCCEEDED, "ab", FinishReason.LENGTH, logprobs=(lp,))
    two = ItemResult(
        b.request.custom_id,
        ItemStatus.SUCCEEDED,
        "ab",
        FinishReason.LENGTH,
        samples=(("ab", FinishReason.LENGTH), ("c", FinishReason.STOP)),
        logprobs=(lp, lp[1:]),
    )
    assert await store.record(a, one) and await store.record(b, two)
    got = {r.custom_id: r for _c, r in await store.results("lp", "0-0", None)}
    assert got[one.custom_id] == one and got[two.custom_id] == two


def counts(b: BatchInfo | None) -> tuple[int, ...]:
    assert b is not None
    return (b.processing, b.succeeded, b.errored, b.cancelled, b.expired)


async def test_cancel_ends_queued_items_at_once_and_lets_running_ones_finish(store: BatchStore) -> None:
    await store.join("cpu")
    info, items = batch("x", 3)
    await store.create(info, "fp", items)
    running = await store.lease_items("cpu", "w", 1, 100)  # c0 starts
    assert [(x.request.custom_id, x.cancelled) for x in running] == [("c0", False)]
    got = await store.cancel("x")
    assert got is not None and got.state is BatchState.CANCELLING and counts(got) == (1, 0, 0, 2, 0)
    again = await store.cancel("x")  # a retried cancel changes nothing
    assert again is not None and counts(again) == (1, 0, 0, 2, 0)
    late = await store.lease_items("cpu", "w", 10, 100)  # the queued copies still on the stream
    assert sorted((x.request.custom_id, x.cancelled) for x in late) == [("c1", True), ("c2", True)]
    for x in late:
        assert await store.record(x, ItemResult.unrun(x.request.custom_id, ItemStatus.CANCELLED, "")) is False
    assert await store.record(running[0], ok("c0")) is True
    end = await store.get("x")
    assert end is not None and end.state is BatchState.CANCELLED and counts(end) == (0, 1, 0, 2, 0)
    assert sorted(r.custom_id for _c, r in await store.results("x", "0-0", None)) == ["c0", "c1", "c2"]
    assert await store.cancel("nope") is None


async def test_a_cancel_with_nothing_running_ends_the_batch_without_any_worker(store: BatchStore) -> None:
    info, items = batch("idle", 2)
    await store.create(info, "fp", items)
    got = await store.cancel("idle")
    assert got is not None and got.state is BatchState.CANCELLED and counts(got) == (0, 0, 0, 2, 0)


async def test_the_sweep_expires_unstarted_items_past_the_deadline_without_any_worker(store: BatchStore) -> None:
    await store.join("cpu")
    info, items = batch("late", 3, window_s=0.5)
    await store.create(info, "fp", items)
    started = await store.lease_items("cpu", "w", 1, 100)
    assert [(x.cancelled, x.expired) for x in started] == [(False, False)]
    early = await store.settle("late")  # before the deadline: nothing to do
    assert early is not None and counts(early) == (3, 0, 0, 0, 0)
    await asyncio.sleep(0.6)  # time passing on purpose: past a deadline the store reads from time.time()
    assert await store.sweep() >= 1
    mid = await store.get("late")
    assert mid is not None and mid.state is BatchState.IN_PROGRESS and counts(mid) == (1, 0, 0, 0, 2)
    rest = await store.lease_items("cpu", "w", 10, 100)
    assert sorted((x.request.custom_id, x.expired) for x in rest) == [("c1", True), ("c2", True)]
    assert await store.record(started[0], ok(started[0].request.custom_id)) is True  # the started one finishes
    end = await store.get("late")
    assert end is not None and end.state is BatchState.EXPIRED and counts(end) == (0, 1, 0, 0, 2)


async def three_run_two_error(store: BatchStore, n: int) -> tuple[list[Lease], BatchInfo | None]:
    """Batch "f" of ``n`` items: three start, the first two end errored (with fail_after 2: failed)."""
    await store.join("cpu")
    info, items = batch("f", n)
    await store.create(info, "fp", items)
    leases = await store.lease_items("cpu", "w", 3, 100)
    for x in leases[:2]:
        await store.record(x, ItemResult(x.request.custom_id, ItemStatus.ERRORED, error_code="invalid_argument"))
    return leases, await store.get("f")


async def test_a_batch_whose_first_results_all_errored_fails(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(redis_settings)
    for store in (RedisBatches(q.client, q.keys, retention_s=60, fail_after=2), MemoryBatches(fail_after=2)):
        leases, failed = await three_run_two_error(store, 5)
        assert failed is not None and failed.state is BatchState.FAILED and "failed" in failed.times
        assert counts(failed) == (1, 0, 2, 2, 0)  # the running third goes on; the two queued end cancelled
        await store.record(leases[2], ok(leases[2].request.custom_id))
        end = await store.get("f")
        assert end is not None and end.state is BatchState.FAILED and counts(end) == (0, 1, 2, 2, 0)
        assert end.results_expire_at > 0
    await q.close()


async def test_an_ended_batch_leaves_the_open_set_and_its_http_link_keeps_only_its_retention(
    redis_settings: RedisSettings,
) -> None:
    """Nothing of a batch outlives its retention once it ended: the sweep's set of open batches
    drops it at once (not at its deadline, which a caller may set years away), and the HTTP door's
    link gets the batch's retention, whether written before the batch ended or after."""
    q = RedisQueue.from_settings(redis_settings)
    store, files = RedisBatches(q.client, q.keys, retention_s=60), RedisFiles(q.client, q.keys)
    try:
        await store.join("cpu")
        for bid in ("linked-first", "ended-first"):
            info, items = batch(bid, 2, window_s=10**9)
            await store.create(info, "fp", items)
            if bid == "linked-first":
                await files.link(bid, {"endpoint": "/v1/chat/completions"}, 10**9)
            for lease in await store.lease_items("cpu", "w", 2, 100):
                assert await store.record(lease, ok(lease.request.custom_id))
            if bid == "ended-first":
                await files.link(bid, {"endpoint": "/v1/chat/completions"}, 10**9)
            assert await q.client.zscore(q.keys.batches_open(), bid) is None
            assert 0 < await q.client.ttl(q.keys.batch_link(bid)) <= 60
            assert await files.linked(bid) == {"endpoint": "/v1/chat/completions"}
    finally:
        await q.close()


async def test_the_sweep_ends_what_a_dead_worker_left_leased(redis_settings: RedisSettings) -> None:
    """No worker alive at all: items a dead worker left leased (untouched past the claim idle time)
    end too, expired past the deadline or cancelled in a cancelled batch, once each, and their
    entries are gone; a live worker's touched item and another batch's items are left alone."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.6)
    stream = q.keys.batch_lane("cpu", "other")
    try:
        await store.join("cpu")
        ends = {}
        for bid, window in (("late", 2.0), ("gone", 3600), ("other", 3600)):  # late: leased well before its end
            info, items = batch(bid, 2, window_s=window)
            await store.create(info, "fp", items)
            ends[bid] = info.expires_at
        dead = await store.lease_items("cpu", "dead", 4, 100)  # late c0 c1, gone c0 c1: its worker dies
        live = await store.lease_items("cpu", "live", 1, 100)  # other c0: its worker lives
        assert [x.request.batch_id for x in dead] == ["late", "late", "gone", "gone"]
        assert [x.request.batch_id for x in live] == ["other"]
        assert await store.record(dead[0], ok("c0")) is True  # late c0 finished before the worker died
        cancelling = await store.cancel("gone")
        assert cancelling is not None and cancelling.state is BatchState.CANCELLING  # two running
        # Time passing on purpose: past late's deadline and the claim idle time.
        await asyncio.sleep(max(ends["late"] - time.time(), 0.6) + 0.1)
        await store.touch("cpu", "live", [live[0].item_ref])  # the sweep must come within the claim idle time
        assert await store.sweep() == 2  # late (deadline) and gone (cancelled: looked at after claim idle)
        late, gone, other = [await store.get(b) for b in ("late", "gone", "other")]
        assert late is not None and late.state is BatchState.EXPIRED and counts(late) == (0, 1, 0, 0, 1)
        assert gone is not None and gone.state is BatchState.CANCELLED and counts(gone) == (0, 0, 0, 2, 0)
        assert other is not None and other.state is BatchState.IN_PROGRESS and counts(other) == (2, 0, 0, 0, 0)
        got = await store.results("late", "0-0", None)
        assert [(r.custom_id, r.status) for _c, r in got] == [("c0", ItemStatus.SUCCEEDED), ("c1", ItemStatus.EXPIRED)]
        assert "worker was gone" in got[1][1].error_message
        assert await store.sweep() == 0  # both left the open set
        assert await store.record(dead[1], ok("c1")) is False  # the dead worker's late result: dropped
        pending = await q.client.xpending(stream, "workers")
        assert pending["pending"] == 1 and await q.client.xlen(stream) == 2  # other's c0 (leased) and c1
    finally:
        await q.close()


async def test_the_sweep_ends_a_failed_batchs_item_left_by_a_dead_worker(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, fail_after=2, claim_idle_s=0.3)
    try:
        _leases, failed = await three_run_two_error(store, 3)
        assert failed is not None and failed.state is BatchState.FAILED and failed.processing == 1  # c2 runs on
        await asyncio.sleep(0.6)  # time passing on purpose: its worker is dead, the claim idle time passes
        assert await store.sweep() == 1  # looked at after the claim idle time, not at its deadline
        end = await store.get("f")
        assert end is not None and end.state is BatchState.FAILED and counts(end) == (0, 0, 2, 1, 0)
        assert end.results_expire_at > 0
        last = (await store.results("f", "0-0", None))[-1][1]
        assert (last.custom_id, last.status) == ("c2", ItemStatus.CANCELLED) and "failed" in last.error_message
    finally:
        await q.close()


async def test_the_sweep_ends_an_item_whose_result_a_failover_lost(redis_settings: RedisSettings) -> None:
    """An item acked whose result is gone (written to a primary that a failover dropped, the ack to
    the new one): the worker that empties the batch's lane has it looked at after the claim idle
    time, and the sweep ends the item errored, so the batch completes; never while an item of the
    batch is still leased or queued."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.3)
    try:
        await store.join("cpu")
        info, items = batch("lost", 3)
        await store.create(info, "fp", items)
        leases = await store.lease_items("cpu", "w", 3, 100)
        await groups.drop(q.client, q.keys.batch_lane("cpu", "lost"), [leases[2].entry_id])  # its ack alone
        assert await store.record(leases[0], ok("c0")) is True
        await q.client.zadd(q.keys.batches_open(), {"lost": 0})  # due now: c1 is still leased
        assert await store.sweep() == 1
        assert counts(await store.get("lost")) == (2, 1, 0, 0, 0)  # nothing ended
        assert await store.record(leases[1], ok("c1")) is True  # the lane is empty now
        await asyncio.sleep(0.4)  # time passing on purpose: the claim idle time
        assert await store.sweep() == 1
        end = await store.get("lost")
        assert end is not None and end.state is BatchState.COMPLETED and counts(end) == (0, 2, 1, 0, 0)
        (lost,) = [r for _c, r in await store.results("lost", "0-0", None) if r.custom_id == "c2"]
        assert lost.status is ItemStatus.ERRORED and lost.error_code == "queue_unavailable"
        assert "lost in a Redis failover" in lost.error_message
    finally:
        await q.close()


async def test_a_late_lease_comes_flagged_expired(store: BatchStore) -> None:
    await store.join("cpu")
    late_info, late_items = batch("late", 1, window_s=-1)  # its window is already over
    await store.create(late_info, "fp", late_items)
    leases = await store.lease_items("cpu", "w", 10, 100)
    assert [(x.cancelled, x.expired) for x in leases] == [(False, True)]
    await store.record(leases[0], ItemResult.unrun("c0", ItemStatus.EXPIRED, ""))
    assert (await store.get("late")).state is BatchState.EXPIRED  # type: ignore[union-attr]


async def test_a_dead_workers_item_behind_many_live_ones_is_reclaimed_within_a_few_calls(
    redis_settings: RedisSettings,
) -> None:
    """XAUTOCLAIM scans 10 x COUNT pending entries per call: a reclaim of one item at a time must go
    on from where the last call stopped, or an item left behind 40 live ones is never found."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60, claim_idle_s=0.5)
    try:
        await store.join("cpu")
        info, items = batch("deep", 41)
        await store.create(info, "fp", items)
        live = await store.lease_items("cpu", "live", 40, 100)
        dead = await store.lease_items("cpu", "dead", 1, 100)  # c40, after the 40 live ones
        assert len(live) == 40 and [x.request.custom_id for x in dead] == ["c40"]
        await asyncio.sleep(0.6)  # time passing on purpose: past the claim idle time
        got = []
        for _ in range(6):  # 10 entries a call: the fifth call reaches c40
            await store.touch("cpu", "live", [x.item_ref for x in live])  # the live worker lives on
            got += await store.reclaim("cpu", "heir", 500, 1)
            if got:
                break
        assert [x.request.custom_id for x in got] == ["c40"]
        await store.touch("cpu", "live", [x.item_ref for x in live])
        assert await store.reclaim("cpu", "heir", 500, 1) == []  # nothing else is idle
    finally:
        await q.close()


def _first_pipeline_fails(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next pipeline ``client`` makes fails as if Redis went away; later ones work."""
    make = client.pipeline
    armed = [True]

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make(*args, **kwargs)
        if armed.pop() if armed else False:

            async def gone(*_a: Any, **_k: Any) -> Any:
                raise redis.exceptions.ConnectionError("Connection closed by server.")

            pipe.execute = gone
        return pipe

    monkeypatch.setattr(client, "pipeline", pipeline)


async def _left_unsealed(
    store: RedisBatches, q: RedisQueue, info: BatchInfo, items: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission that died after the batch's record, with Redis gone for its drop too: the batch
    is stored, not sealed."""
    _first_pipeline_fails(q.client, monkeypatch)

    async def refused(*_a: Any) -> int:
        raise QueueUnavailable("the queue is unreachable")

    monkeypatch.setattr(store.intake, "drop", refused)
    with pytest.raises(QueueUnavailable):
        await store.create(info, "fp", items)
    monkeypatch.undo()
    assert await q.client.hget(q.keys.batch(info.batch_id), "enqueued") is None


async def test_a_submission_that_failed_after_its_record_leaves_nothing(
    redis_settings: RedisSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis dropped the connection after the batch's record was written and before the rest: the
    caller gets UNAVAILABLE and the submission drops what it wrote; its retry stores it anew."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60)
    try:
        await store.join("cpu")
        info, items = batch("dropped", 3, window_s=600)
        _first_pipeline_fails(q.client, monkeypatch)
        with pytest.raises(QueueUnavailable):
            await store.create(info, "fp", items)
        assert await store.get("dropped") is None and await store.owned("t", 10, None) == []
        got, new = await store.create(info, "fp", items)
        assert new and got.total == 3
        leased = await store.lease_items("cpu", "w", 10, 100)
        assert sorted(x.request.custom_id for x in leased) == ["c0", "c1", "c2"]
    finally:
        await q.close()


async def test_a_submission_that_could_not_drop_what_it_wrote_is_completed_by_its_retry(
    redis_settings: RedisSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis went away after the batch's record was written, and stayed away for the drop: the batch
    is left unsealed. The retry queues the items and puts the batch on its owner's list and in the
    sweep's open set, with the times of the first submission."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60)
    try:
        await store.join("cpu")
        info, items = batch("retried", 3, window_s=600)
        await _left_unsealed(store, q, info, items, monkeypatch)
        later = dataclasses.replace(info, created_at=info.created_at + 5, expires_at=info.expires_at + 5)
        got, new = await store.create(later, "fp", items)
        assert not new and got.total == 3 and got.created_at == pytest.approx(info.created_at, abs=0.01)
        assert [b.batch_id for b in await store.owned("t", 10, None)] == ["retried"]
        assert await q.client.zscore(q.keys.batches_open(), "retried") == pytest.approx(info.expires_at, abs=0.01)
        leased = await store.lease_items("cpu", "w", 10, 100)
        assert sorted(x.request.custom_id for x in leased) == ["c0", "c1", "c2"]
        assert await store.intake.drop_unsealed() == 0 and await store.get("retried") is not None  # sealed: kept
    finally:
        await q.close()


async def test_a_batch_whose_submission_was_cut_off_is_not_reported_until_sealed(
    redis_settings: RedisSettings,
) -> None:
    """A gateway killed while it queued a batch's items leaves it unsealed, on its owner's list: neither Get nor
    List reports it (it was not accepted; without its retry the sweep drops it), and pages still fill."""
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60)
    try:
        await store.join("cpu")
        for i, bid in enumerate(["s0", "cut1", "s2", "cut3", "s4", "s5"]):
            info, items = batch(bid, 1)
            await store.create(dataclasses.replace(info, created_at=1000.0 + i), "fp", items)
            if bid.startswith("cut"):  # as its record stands while the submission queues the items
                await q.client.hdel(q.keys.batch(bid), "enqueued")
        assert await store.get("cut3") is None and await store.get("s2") is not None
        assert await store.stored("cut3") and not await store.stored("nothing")  # (its tenant's hold is kept)
        assert [b.batch_id for b in await store.owned("t", 10, None)] == ["s5", "s4", "s2", "s0"]
        assert [b.batch_id for b in await store.owned("t", 3, None)] == ["s5", "s4", "s2"]
        assert [b.batch_id for b in await store.owned("t", 1, 1004.0)] == ["s2"]
        assert await q.client.zcard(q.keys.batches("t")) == 6  # kept listed for the retry that seals them
    finally:
        await q.close()


async def test_an_unsealed_batch_nobody_retries_is_dropped_by_the_sweep(
    redis_settings: RedisSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = RedisQueue.from_settings(redis_settings)
    store = RedisBatches(q.client, q.keys, retention_s=60)
    try:
        await store.join("cpu")
        info, items = batch("orphan", 2, window_s=600)
        await _left_unsealed(store, q, info, items, monkeypatch)
        assert await store.intake.drop_unsealed() == 0  # within its grace: a retry may come
        monkeypatch.setattr(store.intake, "retention", dataclasses.replace(store.intake.retention, unsealed_s=0.0))
        await q.client.zadd(q.keys.batches_unsealed(), {"orphan": 0})
        assert await store.sweep() >= 0 and await store.get("orphan") is None
        assert await q.client.zcard(q.keys.batches_unsealed()) == 0
    finally:
        await q.close()
