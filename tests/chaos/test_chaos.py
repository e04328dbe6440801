"""Faults injected into real processes (redis-server, a gateway process, two worker processes on the
fake engine, started by the tests), with a ledger of every submission and its outcome.

The invariant, checked after each fault: every request that got an id (the x-request-id header)
ends with exactly one terminal outcome its caller saw; a stream's token indexes run 0, 1, 2, ...
with no gap, duplicate or splice; and once the reclaim time has passed, no job is left pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from llamamesh.client import Client, error_reason
from llamamesh.queue import codec
from llamamesh.queue.keys import EVENT_FIELD, WORKER_GROUP, Keys
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import GenerationRequest, SamplingParams
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess, free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

FAST = {
    "LLAMAMESH_WORKER_HEARTBEAT_S": "0.2",
    "LLAMAMESH_WORKER_HEARTBEAT_TTL_S": "0.8",
    "LLAMAMESH_WORKER_CLAIM_IDLE_S": "2",
    "LLAMAMESH_BREAKER_PROBE_INTERVAL_S": "0.3",
    "LLAMAMESH_BREAKER_PROBE_TIMEOUT_S": "2",
    "LLAMAMESH_BREAKER_OPEN_S": "1",
    "LLAMAMESH_WORKER_FAKE_STEP_S": "0.05",
    "LLAMAMESH_WORKER_MAX_INFLIGHT": "32",
    "LLAMAMESH_GATEWAY_GRACE_S": "15",
}


@dataclass
class Outcome:
    request_id: str = ""
    indexes: list[int] = field(default_factory=list)
    finish: str = ""
    error: str = ""
    terminals: int = 0


@dataclass
class Ledger:
    """Submissions (those that got an id) and what their callers saw."""

    entries: list[Outcome] = field(default_factory=list)

    async def stream(
        self,
        stub: pb_grpc.GenerationServiceStub,
        max_tokens: int,
        started: asyncio.Event | None,
        prompt: str = "tell me everything",
    ) -> None:
        out = Outcome()
        call = stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True))
        try:
            out.request_id = dict(await call.initial_metadata())["x-request-id"]
            self.entries.append(out)  # accepted: from here on it must end exactly once
            while (m := await call.read()) is not grpc.aio.EOF:
                out.indexes += range(m.index, m.index + len(m.token_ids))
                if started is not None and out.indexes:
                    started.set()
                if m.finish_reason:
                    out.finish = pb.FinishReason.Name(m.finish_reason)
                    out.terminals += 1
        except grpc.aio.AioRpcError as exc:
            out.error = exc.code().name
            out.terminals += 1

    async def open_streams(
        self, stub: pb_grpc.GenerationServiceStub, count: int, tokens: int
    ) -> list[asyncio.Task[None]]:
        """Start ``count`` streams of ``tokens`` tokens; return once every one has tokens flowing."""
        flowing = [asyncio.Event() for _ in range(count)]
        calls = [asyncio.create_task(self.stream(stub, tokens, ev)) for ev in flowing]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in flowing)), 30)
        return calls

    def ended_once(self) -> None:
        """Every accepted request ended exactly once where its caller saw it, with no gap,
        duplicate or splice in its tokens (whatever the outcome)."""
        for e in self.entries:
            assert e.terminals == 1 and e.indexes == list(range(len(e.indexes))), e

    def whole_or(self, tokens: int, error: str | None) -> None:
        """Each stream completed whole, or (if ``error``) ended with that status."""
        for e in self.entries:
            whole = e.finish == "FINISH_REASON_LENGTH" and len(e.indexes) == tokens
            assert whole or (error is not None and e.error == error), e

    def check(self, accepted: int, tokens: int) -> None:
        assert len(self.entries) == accepted
        for e in self.entries:
            assert e.terminals == 1, e  # one terminal outcome, seen by its caller
            assert e.indexes == list(range(len(e.indexes))), e  # no gap, duplicate or splice
            assert not e.error and e.finish == "FINISH_REASON_LENGTH" and len(e.indexes) == tokens, e


@contextlib.contextmanager
def started(redis_server: RedisProcess, workdir: Path, extra_env: dict[str, str]) -> Iterator[ProcessNode]:
    """A node (gateway + one fake-engine worker) on ``redis_server``, stopped at the end."""
    workdir.mkdir(exist_ok=True)
    n = ProcessNode(workdir, redis_server, engine="fake", extra_env=extra_env)
    n.start()
    try:
        yield n
    finally:
        n.stop()


async def serves(node: ProcessNode, wait_ready: bool = False) -> None:
    """The node serves a new request (first waiting for its pool to be ready again)."""
    if wait_ready:
        ready = f"llamamesh.backend.{node.pool}"
        await asyncio.to_thread(wait_until, lambda: node._serving(ready), 30, "the pool serving again")
    async with grpc.aio.insecure_channel(node.address) as ch:
        after = Ledger()
        await asyncio.wait_for(after.stream(pb_grpc.GenerationServiceStub(ch), 5, None), 60)
        after.check(accepted=1, tokens=5)


def pending(node: ProcessNode) -> int:
    r = redis.Redis.from_url(node.redis.url)
    try:
        return int(r.xpending(Keys(node.prefix).jobs(node.pool), WORKER_GROUP)["pending"])
    finally:
        r.close()


def events_of(node: ProcessNode, request_id: str) -> list[Any]:
    """The entries of a request's event stream (its first attempt's)."""
    r = redis.Redis.from_url(node.redis.url)
    try:
        return list(r.xrange(Keys(node.prefix).events(request_id)))
    finally:
        r.close()


@pytest.fixture
def node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    with started(e2e_redis, tmp_path, FAST) as n:
        yield n


async def test_kill_minus_nine_of_a_worker_holding_twenty_four_streams(node: ProcessNode) -> None:
    """More streams than the breaker's window (20) fail over at once: the pool's breaker stays closed
    (a lost attempt that goes on elsewhere is not a failed request), so every one goes on."""
    ledger = Ledger()
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        calls = await ledger.open_streams(stub, 24, 80)  # 80 x 50 ms = 4 s each
        node.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
        await asyncio.to_thread(wait_until, lambda: '"worker_started"' in node.log("worker2"), 30, "worker 2")
        node.procs["worker"].send_signal(signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*calls), 60)
    ledger.check(accepted=24, tokens=80)  # every stream resumed on worker 2, token for token
    assert '"breaker_transition"' not in node.log("gateway")
    await serves(node)  # at once: no breaker to wait out
    # The dead worker's five leased entries: cancelled by the gateway's failover, then reclaimed
    # (claim idle 2 s) and dropped by worker 2; nothing stays pending.
    await asyncio.to_thread(wait_until, lambda: pending(node) == 0, 15, "no pending jobs")


async def test_sigterm_to_the_gateway_with_twenty_open_streams(node: ProcessNode) -> None:
    ledger = Ledger()
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        calls = await ledger.open_streams(stub, 20, 40)  # 2 s each
        node.procs["gateway"].send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*calls), 60)
    ledger.check(accepted=20, tokens=40)  # drained: every open stream finished within the grace
    assert await asyncio.to_thread(node.procs["gateway"].wait, 30) == 0
    assert '"gateway_stopped"' in node.log("gateway")
    # Nothing left leased: a health probe the gateway queued just before it stopped may still be
    # running on the worker (seen: acked 40 ms after the gateway exited), so wait for it, bounded.
    await asyncio.to_thread(wait_until, lambda: pending(node) == 0, 10, "no pending jobs")


async def test_redis_frozen_for_ten_seconds_then_continued(own_redis: RedisProcess, tmp_path: Path) -> None:
    ledger = Ledger()
    with started(own_redis, tmp_path / "node", FAST) as n:
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 10, 100)  # 5 s each
            assert own_redis.proc is not None
            procs = {"gateway": n.procs["gateway"].pid, "worker": n.procs["worker"].pid}
            cpu0 = {k: cpu_s(pid) for k, pid in procs.items()}
            lines0 = {k: n.log(k).count("\n") for k in procs}
            own_redis.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(10)  # the fault itself: Redis answers nothing for 10 s
            finally:
                own_redis.proc.send_signal(signal.SIGCONT)
            # No tight loops while it was out: CPU time and log lines stay small.
            for k, pid in procs.items():
                cpu, lines = cpu_s(pid) - cpu0[k], n.log(k).count("\n") - lines0[k]
                print(f"during the 10 s freeze: {k} used {cpu:.2f} s CPU and wrote {lines} log lines")
                assert cpu < 2.0 and lines < 100, (k, cpu, lines)
            await asyncio.wait_for(asyncio.gather(*calls), 90)
        assert len(ledger.entries) == 10
        ledger.ended_once()
        ledger.whole_or(100, "UNAVAILABLE")
        # the node recovers by itself: new requests are served
        await serves(n)
        await asyncio.to_thread(wait_until, lambda: pending(n) == 0, 15, "no pending jobs")
        outcomes = sorted(e.finish or e.error for e in ledger.entries)
        print("outcomes after the freeze:", {o: outcomes.count(o) for o in set(outcomes)})


async def test_a_thousand_concurrent_streams_on_the_fake_engine(node: ProcessNode) -> None:
    node.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2", LLAMAMESH_WORKER_MAX_INFLIGHT="512")
    ledger = Ledger()
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        await asyncio.wait_for(asyncio.gather(*(ledger.stream(stub, 10, None) for _ in range(1000))), 150)
    ledger.check(accepted=1000, tokens=10)
    await asyncio.to_thread(wait_until, lambda: pending(node) == 0, 10, "no pending jobs")  # (a probe may be running)


@pytest.mark.parametrize("own_redis", ["always", "everysec"], indirect=True)
async def test_kill_minus_nine_of_redis_mid_stream(own_redis: RedisProcess, tmp_path: Path) -> None:
    """fsync always: nothing is lost, every open stream completes (the gateway rides out the
    restart and reads on). everysec: the last second of writes may be gone; a stream that lost
    events ends UNAVAILABLE, never with a silent gap."""
    ledger = Ledger()
    with started(own_redis, tmp_path / "node", FAST) as n:
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 10, 100)  # 5 s each
            own_redis.kill()
            own_redis.start()  # same port, same AOF
            await asyncio.wait_for(asyncio.gather(*calls), 90)
        assert len(ledger.entries) == 10
        ledger.ended_once()
        ledger.whole_or(100, None if own_redis.appendfsync == "always" else "UNAVAILABLE")
        outcomes = sorted(e.finish or e.error for e in ledger.entries)
        print(f"kill -9 of Redis ({own_redis.appendfsync}):", {o: outcomes.count(o) for o in set(outcomes)})
        await serves(n, wait_ready=True)
        await asyncio.to_thread(wait_until, lambda: pending(n) == 0, 20, "no pending jobs")


async def test_a_backlog_of_ten_thousand_jobs_drains_with_nothing_lost(e2e_redis: RedisProcess, tmp_path: Path) -> None:
    """10,000 jobs queued before any worker runs; two worker processes drain them while their
    acked entries are deleted from the stream (the only trimming the work stream ever sees:
    nothing unleased or pending is removed). Every job ends with exactly one terminal event."""
    env = {**FAST, "LLAMAMESH_WORKER_FAKE_STEP_S": "0", "LLAMAMESH_WORKER_MAX_INFLIGHT": "64"}
    n = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env=env)
    q = RedisQueue.from_settings(RedisSettings(url=e2e_redis.url, prefix=n.prefix))
    ids = [f"b{i}" for i in range(10_000)]
    try:
        await q.join(n.pool)
        for chunk in range(0, len(ids), 50):
            jobs = [
                GenerationRequest(request_id=rid, model="m", prompt="p", sampling=SamplingParams(max_tokens=2))
                for rid in ids[chunk : chunk + 50]
            ]
            await asyncio.gather(*(q.submit(n.pool, job) for job in jobs))
        r = redis.Redis.from_url(e2e_redis.url)
        keys = Keys(n.prefix)
        assert r.xlen(keys.jobs(n.pool)) == 10_000
        n.spawn("worker", "workers")
        n.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
        await asyncio.to_thread(wait_until, lambda: r.xlen(keys.jobs(n.pool)) == 0, 150, "the backlog drained")
        assert pending(n) == 0
        terminals = 0
        for chunk in range(0, len(ids), 1000):
            with r.pipeline(transaction=False) as pipe:
                for rid in ids[chunk : chunk + 1000]:
                    pipe.xrange(keys.events(rid))
                for entries in pipe.execute():
                    evs = [codec.decode_event(f[EVENT_FIELD.encode()]) for _id, f in entries]
                    assert [e.terminal for e in evs].count(True) == 1 and evs[-1].finished is not None
                    assert sum(len(e.token_ids) for e in evs) == 2
                    terminals += 1
        assert terminals == 10_000
        r.close()
    finally:
        n.stop()
        await q.close()


@pytest.mark.parametrize("own_redis", ["none"], indirect=True)
async def test_redis_back_empty_is_not_run_against_silently(own_redis: RedisProcess, tmp_path: Path) -> None:
    """Redis restarts without persistence mid-stream: the open streams end UNAVAILABLE (their jobs
    and events are gone), REQUEST_LOST, which the Python client gives its caller as it is (an
    Attach could only say NOT_FOUND); readiness is NOT_SERVING for a while, then the node serves
    again."""
    env = {**FAST, "LLAMAMESH_GATEWAY_HEALTH_INTERVAL_S": "0.3", "LLAMAMESH_GATEWAY_DATA_LOSS_HOLD_S": "3"}
    ledger = Ledger()
    with started(own_redis, tmp_path / "node", env) as n:
        async with grpc.aio.insecure_channel(n.address) as ch, Client(n.address) as client:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 5, 100)  # 5 s each
            flowing = asyncio.Event()

            async def through_the_client() -> None:
                async for _msg in client.generate("Tell me a story.", max_tokens=100):
                    flowing.set()

            resumable = asyncio.create_task(through_the_client())
            await asyncio.wait_for(flowing.wait(), 30)
            own_redis.kill()
            own_redis.start()  # same port, nothing kept
            await asyncio.to_thread(wait_until, lambda: not n._serving(), 10, "readiness NOT_SERVING")
            await asyncio.wait_for(asyncio.gather(*calls), 60)
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await asyncio.wait_for(resumable, 60)
        ledger.ended_once()
        assert all(e.error == "UNAVAILABLE" and len(e.indexes) < 100 for e in ledger.entries), ledger.entries
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE and error_reason(lost.value) == "REQUEST_LOST"
        assert '"redis_data_lost"' in n.log("gateway")
        await serves(n, wait_ready=True)


async def four_workers(node: ProcessNode) -> None:
    for i in (2, 3, 4):
        node.spawn(f"worker{i}", "workers", LLAMAMESH_WORKER_CONSUMER=f"e2e-worker-{i}")
    started = lambda: all('"worker_started"' in node.log(f"worker{i}") for i in (2, 3, 4))  # noqa: E731
    await asyncio.to_thread(wait_until, started, 30, "four workers")


def crashed_and_dead_letters(node: ProcessNode, crashed: int) -> list[dict[bytes, bytes]]:
    """Assert that ``crashed`` worker processes died of the poison (exit 70); the pool's dead letters."""
    dead = [name for name, p in node.procs.items() if p.poll() is not None]
    assert len(dead) == crashed and all(node.procs[d].returncode == 70 for d in dead), dead
    r = redis.Redis.from_url(node.redis.url)
    try:
        entries: Any = r.xrange(Keys(node.prefix).dead_letters(node.pool))
    finally:
        r.close()
    return [fields for _id, fields in entries]


async def test_poison_jobs_that_raise_and_that_crash_the_worker(node: ProcessNode) -> None:
    """A job that raises ends INTERNAL and the worker lives on. A job that kills its worker before
    its first token is reclaimed by another worker after the claim idle time; once MAX_DELIVERIES (2)
    workers died with it, the next worker sets it aside in the dead-letter stream instead of running
    it and its caller gets the error (INTERNAL); the rest keep serving."""
    await four_workers(node)
    ledger = Ledger()
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        await asyncio.wait_for(ledger.stream(stub, 20, None, prompt="__raise__ please"), 30)
        await asyncio.wait_for(ledger.stream(stub, 20, None, prompt="__crash__ please"), 60)
        raised, crashed = ledger.entries
        assert raised.terminals == 1 and raised.error == "INTERNAL", raised
        assert crashed.terminals == 1 and crashed.error == "INTERNAL", crashed
        letters = crashed_and_dead_letters(node, 2)
        assert len(letters) == 1 and letters[0][b"reason"] == b"the 2 workers that took it died", letters
        await serves(node)
    await asyncio.to_thread(wait_until, lambda: pending(node) == 0, 20, "no pending jobs")


async def test_a_job_that_kills_its_workers_mid_stream_is_set_aside_after_two_deaths(node: ProcessNode) -> None:
    """It crashes each worker after its first token: the gateway knows the worker, fails over once;
    when the second worker dies under it too (GATEWAY_MAX_WORKER_DEATHS 2) it is not sent to a
    third: the stream ends INTERNAL saying so and the request is in the dead-letter stream; the
    other workers serve on."""
    await four_workers(node)
    ledger = Ledger()
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        await asyncio.wait_for(ledger.stream(stub, 20, None, prompt="__crash_late__ please"), 60)
        (crashed,) = ledger.entries
        assert crashed.terminals == 1 and crashed.error == "INTERNAL", crashed
        assert crashed.indexes == list(range(len(crashed.indexes))) and crashed.indexes, crashed  # no gap
        letters = crashed_and_dead_letters(node, 2)
        assert len(letters) == 1 and letters[0][b"deliveries"] == b"2", letters
        await serves(node)
    await asyncio.to_thread(wait_until, lambda: pending(node) == 0, 20, "no pending jobs")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_clients_that_stop_reading_do_not_grow_the_gateway_without_bound(
    e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    """20 clients start 2000-token streams and read nothing. The worker is not held back (it
    finishes them all: events go to Redis, not to the client); the gateway holds at most what
    one generation can be per stream (max_tokens is capped), here a few MiB."""
    env = {**FAST, "LLAMAMESH_WORKER_FAKE_STEP_S": "0.002"}
    with started(e2e_redis, tmp_path, env) as n:
        before = rss_mib(n.procs["gateway"].pid)
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = [
                stub.Generate(pb.GenerateRequest(prompt=f"stalled {i}", max_tokens=2000, ignore_eos=True))
                for i in range(20)
            ]
            for c in calls:
                await c.initial_metadata()  # accepted; never read
            all_done = lambda: n.log("worker").count('"completion_tokens": 2000') >= 20  # noqa: E731
            await asyncio.to_thread(wait_until, all_done, 60, "the worker finishing all")
            grown = rss_mib(n.procs["gateway"].pid) - before
            for c in calls:
                c.cancel()
        print(f"gateway RSS grew {grown:.1f} MiB holding 20 unread 2000-token streams")
        assert grown < 64, grown


async def test_a_stream_whose_gateway_died_is_reattached_through_another(node: ProcessNode) -> None:
    """kill -9 of the gateway a resumable stream runs through: the generation goes on (nobody
    cancels it) and the caller re-attaches through a second gateway from the tokens it has,
    getting exactly the rest of the same generation."""
    port_b = free_port()
    node.spawn("gateway_b", "services", LLAMAMESH_GATEWAY_PORT=str(port_b))
    address_b = f"127.0.0.1:{port_b}"
    await asyncio.to_thread(wait_until, lambda: '"gateway_started"' in node.log("gateway_b"), 30, "gateway b")
    prompt = "resume me please"
    async with grpc.aio.insecure_channel(address_b) as ch_b:
        stub_b = pb_grpc.GenerationServiceStub(ch_b)
        whole = [m async for m in stub_b.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=100))]
        ref = [t for m in whole for t in m.token_ids]
        async with grpc.aio.insecure_channel(node.address) as ch_a:
            call = pb_grpc.GenerationServiceStub(ch_a).Generate(
                pb.GenerateRequest(request_id="survivor", prompt=prompt, max_tokens=100, resumable=True)
            )
            got: list[int] = []
            text = ""
            while len(got) < 10:
                m = await call.read()
                got += m.token_ids
                text += m.text
            node.procs["gateway"].send_signal(signal.SIGKILL)
            node.procs["gateway"].wait(10)
        # Re-attached after the generation went on meanwhile: what queued up arrives joined, cut at
        # the caller's offset with the text of exactly its tokens.
        await asyncio.to_thread(wait_until, lambda: len(events_of(node, "survivor")) > 20, 30, "more tokens")
        rest: list[int] = []
        indexes: list[int] = []
        finish = 0
        async for m in stub_b.Attach(pb.AttachRequest(request_id="survivor", offset=len(got))):
            rest += m.token_ids
            text += m.text
            indexes += range(m.index, m.index + len(m.token_ids))
            finish = m.finish_reason or finish
    assert indexes == list(range(len(got), 100)) and finish == pb.FINISH_REASON_LENGTH
    assert got + rest == ref
    assert text == "".join(m.text for m in whole)


async def test_sigterm_to_a_worker_hands_back_what_it_cannot_finish(e2e_redis: RedisProcess, tmp_path: Path) -> None:
    """SIGTERM to a worker holding 24 streams longer than its grace (1 s): it stops leasing, then
    hands the streams back, and they go on, token for token, on the other worker,
    with the pool's breaker closed throughout (a rolling upgrade refuses nothing)."""
    ledger = Ledger()
    with started(e2e_redis, tmp_path, {**FAST, "LLAMAMESH_WORKER_GRACE_S": "1"}) as n:
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 24, 100)  # 5 s each, all on the first worker
            n.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
            await asyncio.to_thread(wait_until, lambda: '"worker_started"' in n.log("worker2"), 30, "worker 2")
            n.procs["worker"].send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*calls), 60)
            ledger.check(accepted=24, tokens=100)
            await serves(n)  # at once: a drained worker's hand-backs open no breaker
        assert await asyncio.to_thread(n.procs["worker"].wait, 30) == 0
        assert n.log("gateway").count('"request_failed_over"') == 24
        assert '"breaker_transition"' not in n.log("gateway")


async def test_redis_down_for_ten_seconds_backs_off_and_recovers(own_redis: RedisProcess, tmp_path: Path) -> None:
    """Redis killed and restarted 10 s later on its AOF (fsync always): meanwhile gateway and
    worker retry with backoff (bounded CPU and log lines, no tight loop); afterwards the open
    streams carry on where they were and the node serves new requests, all by itself."""
    ledger = Ledger()
    with started(own_redis, tmp_path / "node", FAST) as n:
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 5, 100)  # 5 s each, more with the outage
            procs = {"gateway": n.procs["gateway"].pid, "worker": n.procs["worker"].pid}
            cpu0 = {k: cpu_s(pid) for k, pid in procs.items()}
            lines0 = {k: n.log(k).count("\n") for k in procs}
            own_redis.kill()
            await asyncio.sleep(10)  # the fault itself: no Redis for 10 s
            used = {k: (cpu_s(pid) - cpu0[k], n.log(k).count("\n") - lines0[k]) for k, pid in procs.items()}
            own_redis.start()
            await asyncio.wait_for(asyncio.gather(*calls), 90)
        for k, (cpu, lines) in used.items():
            print(f"Redis down 10 s: {k} used {cpu:.2f} s CPU and wrote {lines} log lines")
            assert cpu < 3.0 and lines < 120, (k, cpu, lines)
        ledger.ended_once()
        outcomes = sorted(e.finish or e.error for e in ledger.entries)
        print("outcomes after 10 s without Redis:", {o: outcomes.count(o) for o in set(outcomes)})
        await serves(n, wait_ready=True)


def finished_ids(node: ProcessNode, names: list[str]) -> list[str]:
    """The request ids of every job_finished line in these processes' logs."""
    out = []
    for name in names:
        for line in node.log(name).splitlines():
            if '"job_finished"' in line:
                out.append(json.loads(line)["request_id"])
    return out


async def test_a_generation_three_times_longer_than_the_claim_idle_time_runs_once(node: ProcessNode) -> None:
    node.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
    await asyncio.to_thread(wait_until, lambda: '"worker_started"' in node.log("worker2"), 30, "worker 2")
    ledger = Ledger()
    async with grpc.aio.insecure_channel(node.address) as ch:
        # 130 steps of 50 ms: 6.5 s, over three times the 2 s claim idle time; both workers reclaim every 1 s
        await asyncio.wait_for(ledger.stream(pb_grpc.GenerationServiceStub(ch), 130, None), 60)
    ledger.check(accepted=1, tokens=130)
    rid = ledger.entries[0].request_id
    # the worker logs job_finished just after publishing the terminal event: wait for the line, and for
    # no job to be left pending (a takeover would still be running or pending), then count
    await asyncio.to_thread(wait_until, lambda: rid in finished_ids(node, ["worker", "worker2"]), 10, "job_finished")
    await asyncio.to_thread(wait_until, lambda: pending(node) == 0, 10, "no pending jobs")
    assert finished_ids(node, ["worker", "worker2"]).count(rid) == 1  # executed once, never taken over


async def test_four_workers_racing_over_fifty_stale_jobs_run_each_once(e2e_redis: RedisProcess, tmp_path: Path) -> None:
    """50 jobs leased by a worker that died before running any: four worker processes reclaim them
    (claim idle 2 s) at once; every job runs exactly once and ends with one terminal event."""
    # 4 jobs at a time of ~0.6 s each: one worker alone would take ~8 s over the 50, so the ones that
    # start later (process start-up is staggered on 2 cores) take their share
    slow = {"LLAMAMESH_WORKER_FAKE_STEP_S": "0.2", "LLAMAMESH_WORKER_MAX_INFLIGHT": "4"}
    n = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env={**FAST, **slow})
    q = RedisQueue.from_settings(RedisSettings(url=e2e_redis.url, prefix=n.prefix))
    ids = [f"stale{i}" for i in range(50)]
    try:
        await q.join(n.pool)
        for rid in ids:
            await q.submit(
                n.pool, GenerationRequest(request_id=rid, model="m", prompt="p", sampling=SamplingParams(max_tokens=3))
            )
        assert len(await q.lease(n.pool, "ghost", 50, 500)) == 50  # ghost dies holding them all
        names = [f"racer{i}" for i in range(4)]
        for name in names:
            n.spawn(name, "workers", LLAMAMESH_WORKER_CONSUMER=name)
        await asyncio.to_thread(wait_until, lambda: len(finished_ids(n, names)) >= 50, 60, "all 50 run")
        done = finished_ids(n, names)
        assert sorted(done) == sorted(ids), sorted(done)  # each exactly once
        assert len({name for name in names if any(r in n.log(name) for r in ids)}) >= 2  # really raced
        evs = await asyncio.gather(*(asyncio.wait_for(_events(q, rid), 10) for rid in ids))
        assert all([e.terminal for e in es].count(True) == 1 and es[-1].finished is not None for es in evs)
        await asyncio.to_thread(wait_until, lambda: pending(n) == 0, 10, "no pending jobs")
    finally:
        n.stop()
        await q.close()


async def _events(q: RedisQueue, rid: str) -> list:
    return [e async for _i, e in q.events(rid)]
