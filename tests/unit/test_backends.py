"""Routing and fallback decisions of services/backends.py over the in-memory queue (no probes run:
``start`` is not called; ``refresh`` and ``record`` are driven by hand)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from llamamesh import errors
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import BreakerSettings
from llamamesh.types import WorkerStatus
from services.backends import WAIT_HALF_LIFE_S, Backends, backend_service
from services.breaker import State

S = BreakerSettings(probe_failures=3, error_rate=0.5, window=4, min_requests=2, open_s=60)


async def backends(*live: str) -> tuple[Backends, MemoryQueue, list[tuple[str, bool]]]:
    q = MemoryQueue()
    for pool in live:
        await q.heartbeat(WorkerStatus(worker=f"w-{pool}", pool=pool), ttl_s=60)
    health: list[tuple[str, bool]] = []

    async def on_health(pool: str, up: bool) -> None:
        health.append((pool, up))

    b = Backends(q, ["trtllm"], {"trtllm": "vllm", "vllm": "trtllm"}, S, on_health=on_health)
    for p in b.pools.values():
        await b.refresh(p)
    return b, q, health


async def test_a_live_pool_takes_its_own_requests() -> None:
    b, _q, health = await backends("trtllm", "vllm")
    for counter in ("llamamesh_failovers_total", "llamamesh_dead_letters_total"):  # at 0 before the first event
        assert REGISTRY.get_sample_value(counter, {"pool": "vllm"}) is not None
    assert b.route("trtllm") == "trtllm"
    assert sorted(health) == [("trtllm", True), ("vllm", True)]
    assert backend_service("trtllm") == "llamamesh.backend.trtllm"


async def test_no_live_worker_goes_to_the_fallback() -> None:
    b, _q, health = await backends("vllm")
    assert ("trtllm", False) in health
    assert b.route("trtllm") == "vllm"
    assert b.stranded("trtllm") and not b.stranded("vllm")


async def test_neither_live_queues_on_the_pool_until_its_breaker_opens() -> None:
    b, _q, _h = await backends()
    assert b.route("trtllm") == "trtllm"  # waits in the stream for a worker (a restart)
    for _ in range(3):
        await b.probes.result(b.pools["trtllm"], "no live worker")
    with pytest.raises(errors.NoWorkers, match="has no live worker"):
        b.route("trtllm")


async def test_backend_failures_open_the_breaker_and_client_errors_do_not() -> None:
    b, _q, health = await backends("trtllm", "vllm")
    for _ in range(10):
        await b.record("trtllm", errors.InvalidRequest.field("top_p", "bad"))
        await b.record("trtllm", errors.NotFound("model"))
    assert b.pools["trtllm"].breaker.state is State.CLOSED
    await b.record("trtllm", errors.EngineDead("boom"))
    await b.record("trtllm", errors.WorkerLost("gone"))
    assert b.pools["trtllm"].breaker.state is State.OPEN
    assert health[-1] == ("trtllm", False)
    assert b.route("trtllm") == "vllm"  # open: the fallback takes it


async def test_a_worker_coming_back_revives_the_pool() -> None:
    b, q, _h = await backends("vllm")
    trt = b.pools["trtllm"]
    for _ in range(3):
        await b.probes.result(trt, "no live worker")
    assert trt.breaker.state is State.OPEN
    await q.heartbeat(WorkerStatus(worker="w-trtllm", pool="trtllm"), ttl_s=60)
    await b.refresh(trt)
    # It opened only because the pool never had a worker (a cold start): nothing failed, so the
    # first worker closes it outright (a burst after a cold start is served, not refused half-open).
    assert trt.breaker.state is State.CLOSED
    assert b.worker_alive("trtllm", "w-trtllm") and not b.worker_alive("trtllm", "w-other")
    for _ in range(3):  # now its worker fails the probes: opened by failures
        await b.probes.result(trt, "deadline_exceeded: no answer")
    assert trt.breaker.state is State.OPEN
    await q.leave("trtllm", "w-trtllm")
    await b.refresh(trt)
    assert not trt.live
    await q.heartbeat(WorkerStatus(worker="w-trtllm", pool="trtllm"), ttl_s=60)
    await b.refresh(trt)
    assert trt.breaker.state is State.HALF_OPEN  # a worker is back, but it failed before: a trial first
    await q.leave("trtllm", "w-trtllm")
    await b.refresh(trt)
    for _ in range(3):  # its workers went away: "no live worker" (what they failed was counted then)
        await b.probes.result(trt, "no live worker")
    assert trt.breaker.state is State.OPEN
    await q.heartbeat(WorkerStatus(worker="w-trtllm", pool="trtllm", state="starting"), ttl_s=60)
    await b.refresh(trt)
    # a worker (re)starting: the pool is coming up, its requests wait instead of being refused
    assert trt.breaker.state is State.CLOSED and trt.starting and not trt.live


async def test_a_worker_back_from_a_hang_is_tried_half_open_and_a_new_one_closes_the_breaker() -> None:
    b, q, _h = await backends("vllm", "trtllm")
    trt = b.pools["trtllm"]
    await q.leave("trtllm", "w-trtllm")  # its heartbeat stops (a hung process: SIGSTOP, a long GC)
    await b.refresh(trt)
    for _ in range(3):
        await b.probes.result(trt, "no live worker")
    assert trt.breaker.state is State.OPEN and trt.opened_empty
    await q.heartbeat(WorkerStatus(worker="w-trtllm", pool="trtllm"), ttl_s=60)  # it goes on, never restarted
    await b.refresh(trt)
    assert trt.breaker.state is State.HALF_OPEN
    assert "w-trtllm is back" in trt.breaker.transitions[-1].reason
    for _ in range(2):
        assert trt.breaker.allow()
        trt.breaker.record(True, probe=True)
    assert trt.breaker.state is State.CLOSED
    await q.leave("trtllm", "w-trtllm")  # gone again; this time another worker replaces it
    await b.refresh(trt)
    for _ in range(3):
        await b.probes.result(trt, "no live worker")
    await q.heartbeat(WorkerStatus(worker="w-new", pool="trtllm"), ttl_s=60)
    await b.refresh(trt)
    assert trt.breaker.state is State.CLOSED  # nothing failed and nothing came back: a new worker serves at once
    await q.leave("trtllm", "w-new")  # and a restart keeping its name (a container's), ready anew
    await b.refresh(trt)
    for _ in range(3):
        await b.probes.result(trt, "no live worker")
    await q.heartbeat(WorkerStatus(worker="w-new", pool="trtllm", since_unix_s=1.0), ttl_s=60)
    await b.refresh(trt)
    assert trt.breaker.state is State.CLOSED


async def test_a_starting_pool_is_coming_up_not_failing() -> None:
    b, q, health = await backends("vllm")
    trt = b.pools["trtllm"]
    await q.heartbeat(WorkerStatus(worker="w1", pool="trtllm", state="starting", detail="loading"), ttl_s=60)
    for _ in range(5):  # probes of a starting pool hold nothing against it
        await b.probe(trt)
    assert trt.breaker.state is State.CLOSED and trt.probes == 0
    assert trt.last_probe_error == "starting: worker w1 is starting: loading"
    assert not trt.serving() and ("trtllm", True) not in health
    assert b.empty_for("trtllm") == 0.0 and b.starting_for("trtllm") >= 0.0
    assert b.route("trtllm") == "vllm"  # its fallback is live: it takes the request meanwhile
    assert not b.worker_alive("trtllm", "w-gone") and b.worker_alive("trtllm", "w1")
    await q.heartbeat(WorkerStatus(worker="w1", pool="trtllm", state="failed", detail="no model"), ttl_s=60)
    await b.refresh(trt)
    assert not trt.present and not b.worker_alive("trtllm", "w1")
    assert b.what_is_wrong("trtllm") == "worker w1 is failed: no model"
    for _ in range(3):  # only a failed worker: absent, and the probes say why
        await b.probe(trt)
    assert trt.breaker.state is State.OPEN and "no model" in trt.last_probe_error


@pytest.mark.timeout(10)
async def test_stop_ends_the_probe_loops_even_when_a_probe_swallows_the_cancel() -> None:
    """Python 3.11's asyncio.wait_for can swallow a cancel that lands as the awaited probe ends
    (gh-86296): the loop must still end, or the gateway never exits after SIGTERM."""
    q = MemoryQueue()
    b = Backends(q, ["cpu"], {}, BreakerSettings(probe_interval_s=0.01))
    probing = asyncio.Event()
    swallowed: list[bool] = []

    async def probe(_p: object) -> None:
        probing.set()
        try:
            await asyncio.Event().wait()  # a probe that never ends by itself
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)  # the first cancel is lost, as in the race

    b.probes.probe = probe  # type: ignore[method-assign,assignment]
    await b.start()
    await asyncio.wait_for(probing.wait(), 5)
    await asyncio.wait_for(b.stop(), 5)
    assert swallowed


async def test_the_expected_queue_wait_is_the_recent_one_only_while_the_pool_is_full() -> None:
    now = [1000.0]
    q = MemoryQueue()
    full = WorkerStatus(worker="w", pool="cpu", inflight=4, max_inflight=4)
    await q.heartbeat(full, ttl_s=60)
    b = Backends(q, ["cpu"], {}, S, clock=lambda: now[0])
    pool = b.pools["cpu"]
    await b.refresh(pool)
    for _ in range(4):
        b.observe_queue_wait("cpu", 8.0)
    assert b.expected_queue_wait("cpu") == 0.0  # too few samples to go by
    b.observe_queue_wait("cpu", 8.0)
    assert b.expected_queue_wait("cpu") == 8.0
    now[0] += 10.0  # nothing finished since: it fades (halved every WAIT_HALF_LIFE_S)
    assert b.expected_queue_wait("cpu") == pytest.approx(8.0 * 0.5 ** (10.0 / WAIT_HALF_LIFE_S))
    await q.heartbeat(replace(full, inflight=3), ttl_s=60)  # a slot free, nothing waiting: no wait
    await b.refresh(pool)
    assert b.expected_queue_wait("cpu") == 0.0
    pool.waiting = 2  # jobs waiting at the last probe: the free slot is theirs
    assert b.expected_queue_wait("cpu") == pytest.approx(8.0 * 0.5 ** (10.0 / WAIT_HALF_LIFE_S))
