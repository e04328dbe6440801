"""Tenants' budgets in Redis (llamamesh/queue/quotas.py), on redis-server and Valkey: each check is
atomic, so racing gateways never pass a budget together, and what is held is given back once."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest

from llamamesh.errors import AlreadyExists, RateLimited
from llamamesh.queue.quotas import RedisQuotas
from llamamesh.queue.redisio import connect
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import LimitsSettings, RedisSettings

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


@pytest.fixture
async def quotas(redis_settings: RedisSettings) -> AsyncIterator[RedisQuotas]:
    q = RedisQueue.from_settings(redis_settings)
    yield RedisQuotas(q.client, q.keys)
    await q.close()


async def outcomes(n: int, call: object) -> list[bool]:
    async def one() -> bool:
        try:
            await call()  # type: ignore[operator]
            return True
        except RateLimited:
            return False

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_racing_requests_never_pass_the_burst_and_the_bucket_refills(
    quotas: RedisQuotas, redis_settings: RedisSettings
) -> None:
    limits = LimitsSettings(requests_per_s=10, burst=5)
    # Two "gateways": two clients of their own, racing for one tenant's bucket.
    other = RedisQuotas(connect(redis_settings), quotas.keys)
    got = await asyncio.gather(
        outcomes(10, lambda: quotas.admit("t", limits)), outcomes(10, lambda: other.admit("t", limits))
    )
    assert sum(got[0]) + sum(got[1]) == 5
    with pytest.raises(RateLimited) as exc:
        await quotas.admit("t", limits)
    assert 0 < exc.value.retry_after_s <= 0.1 and "LLAMAMESH_LIMITS_REQUESTS_PER_S" in exc.value.message
    await asyncio.sleep(exc.value.retry_after_s)  # time passing on purpose: the bucket refills by Redis's clock
    await quotas.admit("t", limits)
    await quotas.admit("other-tenant", limits)  # its own bucket
    await other._r.aclose()


async def test_tokens_are_admitted_while_the_budget_is_above_zero_and_spent_after(quotas: RedisQuotas) -> None:
    limits = LimitsSettings(tokens_per_min=6000)  # 100 a second
    await quotas.admit("t", limits)
    await quotas.spend("t", limits, 6100)  # 100 in debt
    with pytest.raises(RateLimited) as exc:
        await quotas.admit("t", limits)
    assert 0.9 < exc.value.retry_after_s <= 1.05 and "LLAMAMESH_LIMITS_TOKENS_PER_MIN" in exc.value.message
    await asyncio.sleep(exc.value.retry_after_s)  # time passing on purpose: the debt is paid by Redis's clock
    await quotas.admit("t", limits)


async def test_a_request_reserves_what_it_may_generate_and_gets_back_what_it_did_not(quotas: RedisQuotas) -> None:
    """A burst of requests admitted at once cannot spend many minutes' worth: each holds its most
    (max_tokens x n) from admission until it ends and settles what it generated."""
    limits = LimitsSettings(tokens_per_min=600)  # 10 a second
    await quotas.admit("r", limits, reserve=400)
    await quotas.admit("r", limits, reserve=400)  # 200 left: admitted, the bucket now 200 in debt
    with pytest.raises(RateLimited) as exc:
        await quotas.admit("r", limits, reserve=1)
    assert 19 < exc.value.retry_after_s <= 21, exc.value.retry_after_s
    await quotas.spend("r", limits, 10 - 400)  # both generated 10: 780 given back, capped at a full bucket
    await quotas.spend("r", limits, 10 - 400)
    for _ in range(4):  # 580 (a full bucket less the 20 spent): 390, 200, 10, then -180
        await quotas.admit("r", limits, reserve=190)
    with pytest.raises(RateLimited):
        await quotas.admit("r", limits, reserve=190)


async def test_no_limits_cost_no_round_trip(quotas: RedisQuotas) -> None:
    await quotas._r.aclose()  # a closed client would fail any command
    unlimited = LimitsSettings()
    await quotas.admit("t", unlimited)
    await quotas.spend("t", unlimited, 10)
    await quotas.open_stream("t", unlimited, "s")


async def test_streams_are_held_renewed_and_freed_by_their_lease(
    quotas: RedisQuotas, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = LimitsSettings(max_streams=2)
    got = await outcomes(5, lambda: quotas.open_stream("t", limits, f"s{time.monotonic_ns()}"))
    assert sum(got) == 2
    members = [m.decode() for m in await quotas._r.zrange(quotas.keys.tenant_streams("t"), 0, -1)]
    with pytest.raises(RateLimited, match="LLAMAMESH_LIMITS_MAX_STREAMS"):
        await quotas.open_stream("t", limits, "another")
    await quotas.close_stream("t", members[0])
    await quotas.open_stream("t", limits, "another")
    # A gateway that died stops renewing: its streams free themselves when the lease ends.
    monkeypatch.setattr(quotas, "retention", dataclasses.replace(quotas.retention, stream_lease_ms=300))
    await quotas.renew_streams({"another": "t"})  # renewed with the short lease; members[1] keeps 30 s
    await quotas._r.zadd(quotas.keys.tenant_streams("t"), {members[1]: 0})  # as if its lease had ended
    await quotas.open_stream("t", limits, "third")  # members[1] was expired, so there is room
    with pytest.raises(RateLimited):
        await quotas.open_stream("t", limits, "fourth")
    await asyncio.sleep(0.35)  # time passing on purpose: "another"'s short lease ends, nobody renews it
    await quotas.open_stream("t", limits, "fourth")


async def test_batches_reserve_once_and_give_back_items_when_ended_and_bytes_when_purged(
    quotas: RedisQuotas,
) -> None:
    limits = LimitsSettings(max_batch_items=10, max_batch_bytes=1000)
    k = quotas.keys
    assert await quotas.reserve_batch("t", limits, "t/a", 6, 400) is True
    assert await quotas.reserve_batch("t", limits, "t/a", 6, 400) is False  # a resubmission holds nothing more
    with pytest.raises(RateLimited, match="LLAMAMESH_LIMITS_MAX_BATCH_ITEMS"):
        await quotas.reserve_batch("t", limits, "t/b", 5, 100)
    with pytest.raises(RateLimited, match="LLAMAMESH_LIMITS_MAX_BATCH_BYTES"):
        await quotas.reserve_batch("t", limits, "t/c", 1, 700)
    got = await asyncio.gather(
        *(quotas.reserve_batch("t", limits, f"t/r{i}", 1, 10) for i in range(8)), return_exceptions=True
    )
    assert sum(x is True for x in got) == 4  # 6 + 4 = 10 items, never more
    await quotas._r.hset(k.batch("t/a"), "state", "in_progress")
    assert await quotas.give_back() == 0  # running: it holds on
    await quotas._r.hset(k.batch("t/a"), "state", "completed")
    assert await quotas.give_back() == 1 and await quotas.give_back() == 0  # once
    assert await quotas.reserve_batch("t", limits, "t/b", 6, 100) is True  # its items are free
    with pytest.raises(RateLimited, match="BYTES"):  # 400 + 40 + 100 held; its bytes are kept
        await quotas.reserve_batch("t", limits, "t/d", 0, 500)
    await quotas._r.delete(k.batch("t/a"))  # purged (its retention ended)
    # With no grace, every hold without a record goes: t/a (purged) and the test's record-less ones.
    assert await quotas.give_back(grace_s=0) == 6
    assert await quotas.reserve_batch("t", limits, "t/d", 0, 500) is True
    quota = await quotas._r.hgetall(k.tenant_batch_quota("t"))
    assert {f.decode(): int(v) for f, v in quota.items()} == {"items": 0, "bytes": 500}


async def test_a_hold_without_a_batch_record_waits_out_the_grace(quotas: RedisQuotas) -> None:
    """A batch being stored has a hold before its record: the sweep does not take it back early."""
    limits = LimitsSettings(max_batch_items=5)
    assert await quotas.reserve_batch("t", limits, "t/new", 5, 10)
    assert await quotas.give_back() == 0  # no record yet, but only just reserved
    with pytest.raises(RateLimited):
        await quotas.reserve_batch("t", limits, "t/more", 1, 1)
    await quotas.unreserve_batch("t", "t/new")  # its BatchGenerate failed: all of it comes back
    assert await quotas.reserve_batch("t", limits, "t/more", 5, 1)


async def test_of_two_batches_under_one_id_the_first_to_reserve_holds_it_and_the_other_is_refused(
    quotas: RedisQuotas,
) -> None:
    """Racing submissions of different items under one id: the second is AlreadyExists at once (had
    it gone on, its batch could be the one stored, under the first one's smaller hold, which that
    one's AlreadyExists then gave back); the first one's resubmission holds nothing more."""
    limits = LimitsSettings(max_batch_items=100)
    assert await quotas.reserve_batch("t", limits, "t/x", 1, 10, fingerprint="small") is True
    with pytest.raises(AlreadyExists, match="names another batch"):
        await quotas.reserve_batch("t", limits, "t/x", 100, 1000, fingerprint="large")
    assert await quotas.reserve_batch("t", limits, "t/x", 1, 10, fingerprint="small") is False
    quota = await quotas._r.hgetall(quotas.keys.tenant_batch_quota("t"))
    assert {f.decode(): int(v) for f, v in quota.items()} == {"items": 1, "bytes": 10}


async def test_a_hold_written_while_the_sweep_unlists_its_tenant_is_found_by_the_next_sweep(
    quotas: RedisQuotas, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep unlists a tenant that holds nothing; a reservation landing between its look and
    its unlisting must not leave a hold no sweep will ever give back."""
    limits = LimitsSettings(max_batch_items=5)
    k = quotas.keys
    await quotas._r.sadd(k.tenants_holding(), "t")  # listed, holding nothing yet
    srem = quotas._r.srem

    async def reserved_meanwhile(*args: object) -> object:
        monkeypatch.setattr(quotas._r, "srem", srem)
        got = await srem(*args)  # type: ignore[arg-type]
        assert (
            await quotas._reserve(
                keys=[k.tenant_batch_quota("t"), k.tenant_batches_held("t")], args=["t/b", 5, 1, 5, 0, "fp"]
            )
            == 0
        )
        return got

    monkeypatch.setattr(quotas._r, "srem", reserved_meanwhile)
    assert await quotas.give_back() == 0
    assert await quotas._r.sismember(k.tenants_holding(), "t")
    await quotas._r.hset(k.batch("t/b"), "state", "completed")
    assert await quotas.give_back() == 1  # its items are free again
    assert await quotas.reserve_batch("t", limits, "t/c", 5, 1)
