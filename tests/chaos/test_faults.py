"""Redis faults that leave the processes up: replies lost after their write applied (a proxy in
front of the worker's Redis), Redis back from its AOF without its last second of writes, and a
3-s Redis outage while streams are open and new requests keep arriving.

Same processes and ledger as test_chaos.py (a gateway and a fake-engine worker, started by the
tests, on a redis-server of the test's own); the invariants are the same: every accepted request
ends exactly once where its caller sees it, with its token indexes running 0, 1, 2, ... and no
token twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any  # redis-py types stream replies loosely

import grpc
import pytest
import redis

from llamamesh.queue import codec
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, Keys
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.chaos.proxy import ReplyDropper
from tests.chaos.test_chaos import FAST, Ledger, Outcome, pending, serves, started
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@dataclass
class Seen(Outcome):
    """An Outcome plus what the last message or the status said, and when."""

    max_tokens: int = 0  # asked for
    completion_tokens: int = -1  # usage on the final message
    details: str = ""  # the status message of an error
    sent_s: float = 0.0  # time.monotonic()
    first_token_s: float = 0.0
    ended_s: float = 0.0


@dataclass
class FaultLedger(Ledger):
    """A Ledger that keeps usage and error messages, and wakes waiters on every message."""

    moved: asyncio.Event = field(default_factory=asyncio.Event)

    async def stream(
        self,
        stub: pb_grpc.GenerationServiceStub,
        max_tokens: int,
        started: asyncio.Event | None,
        prompt: str = "tell me everything",
    ) -> None:
        await self.generate(stub, max_tokens, started, prompt)

    async def generate(
        self,
        stub: pb_grpc.GenerationServiceStub,
        max_tokens: int,
        started: asyncio.Event | None = None,
        prompt: str = "tell me everything",
        timeout_s: float | None = None,
    ) -> Seen:
        out = Seen(max_tokens=max_tokens, sent_s=time.monotonic())
        call = stub.Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True), timeout=timeout_s
        )
        try:
            # no id: refused before it was accepted (the read below raises the status)
            out.request_id = str(dict(await call.initial_metadata()).get("x-request-id", ""))
            if out.request_id:
                self.entries.append(out)  # accepted: from here on it must end exactly once
            while (m := await call.read()) is not grpc.aio.EOF:
                out.indexes += range(m.index, m.index + len(m.token_ids))
                if out.indexes and not out.first_token_s:
                    out.first_token_s = time.monotonic()
                if started is not None and out.indexes:
                    started.set()
                if m.finish_reason:
                    out.finish = pb.FinishReason.Name(m.finish_reason)
                    out.completion_tokens = m.usage.completion_tokens
                    out.terminals += 1
                self.moved.set()
        except grpc.aio.AioRpcError as exc:
            out.error = exc.code().name
            out.details = exc.details() or ""
            out.terminals += 1
        finally:
            out.ended_s = time.monotonic()
            self.moved.set()
        return out

    def tokens(self) -> int:
        return sum(len(e.indexes) for e in self.entries)


async def no_pending(node: ProcessNode, timeout_s: float) -> None:
    """Wait until no job of the pool is pending; else fail naming the pending entries and their jobs."""
    try:
        await asyncio.to_thread(wait_until, lambda: pending(node) == 0, timeout_s, "no pending jobs")
    except TimeoutError:
        r = redis.Redis.from_url(node.redis.url)
        try:
            stream = Keys(node.prefix).jobs(node.pool)
            stale: Any = r.xpending_range(stream, WORKER_GROUP, "-", "+", 20)
            entries: Any = r.xrange(stream)
            jobs = {eid.decode(): codec.decode_job(f[JOB_FIELD.encode()]).request_id for eid, f in entries}
        finally:
            r.close()
        left = [
            (
                p["message_id"].decode(),
                p["consumer"].decode(),
                p["time_since_delivered"],
                p["times_delivered"],
                jobs.get(p["message_id"].decode()),
            )
            for p in stale
        ]
        what = "(entry, consumer, idle ms, deliveries, request)"
        raise AssertionError(f"jobs still pending after {timeout_s:g} s, {what}: {left}") from None


def tally(entries: list[Outcome]) -> dict[str, int]:
    outcomes = [e.finish or e.error for e in entries]
    return {o: outcomes.count(o) for o in sorted(set(outcomes))}


def log_events(node: ProcessNode, name: str, event: str, since: int = 0) -> list[dict[str, object]]:
    """The JSON log lines of process ``name`` with this event, from character ``since`` on."""
    out = []
    for line in node.log(name)[since:].splitlines():
        if f'"{event}"' in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own with AOF fsync'd on every write (the test kills it)."""
    kind = "redis" if shutil.which("redis-server") else "valkey"
    server = RedisProcess(kind, tmp_path / "redis", appendonly=True, appendfsync="always")
    server.start()
    yield server
    server.stop()


# ---- 1. replies lost after the write applied ----------------------------------------------------


@contextlib.contextmanager
def started_behind(
    proxy: ReplyDropper, redis_server: RedisProcess, workdir: Path, extra_env: dict[str, str]
) -> Iterator[ProcessNode]:
    """A node whose gateway talks to ``redis_server`` directly and whose worker goes through ``proxy``."""
    workdir.mkdir(exist_ok=True)
    n = ProcessNode(workdir, redis_server, engine="fake", extra_env=extra_env)
    n.spawn("gateway", "services")
    n.spawn("worker", "workers", LLAMAMESH_REDIS_URL=proxy.url)
    try:
        deadline = time.monotonic() + 120
        n._wait(lambda: n._serving(), deadline, "the gateway to be SERVING")
        n._wait(lambda: '"worker_started"' in n.log("worker"), deadline, "the worker to start")
        n._wait(lambda: n._serving(f"llamamesh.backend.{n.pool}"), deadline, "the pool to be SERVING")
        yield n
    finally:
        n.stop()


async def test_event_writes_whose_replies_are_lost_are_not_delivered_twice(
    e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    """The worker's connection drops after Redis applied a publish of events but before its reply
    came back (three times, one publish each), then every publish reply is lost until the worker
    says it failed to publish. The worker cannot know whether the write happened and writes again;
    each caller still gets its 150 tokens once each, and usage counts what it got."""
    proxy = ReplyDropper(e2e_redis.port)
    proxy.start()
    env = {**FAST, "LLAMAMESH_WORKER_FAKE_STEP_S": "0.02"}  # 150 tokens: 3 s without faults
    ledger = FaultLedger()
    try:
        with started_behind(proxy, e2e_redis, tmp_path / "node", env) as n:
            async with grpc.aio.insecure_channel(n.address) as ch:
                calls = await ledger.open_streams(pb_grpc.GenerationServiceStub(ch), 5, 150)
                ended = lambda: all(c.done() for c in calls)  # noqa: E731
                for drop, at in enumerate((20, 45, 70), start=1):  # tokens into each stream
                    reached = lambda at=at: ledger.tokens() >= 5 * at or ended()  # noqa: E731
                    await until(reached, 30, f"{at} tokens each", wake=ledger.moved)
                    if ended():
                        break
                    proxy.drop_after_next_write()
                    await asyncio.to_thread(proxy.wait_drops, drop, 10)
                if not ended():
                    # A link that keeps losing replies, longer than the client's own reconnects: until
                    # the worker says that a publish failed (after the single drops, once more).
                    proxy.drop_every_write(True)
                    try:
                        await asyncio.to_thread(proxy.wait_drops, 4, 10)
                        failures = len(log_events(n, "worker", "events_publish_failed"))  # (those of the drops before)
                        failed = lambda: len(log_events(n, "worker", "events_publish_failed")) > failures  # noqa: E731
                        await asyncio.to_thread(wait_until, failed, 30, "the worker to log events_publish_failed")
                    finally:
                        proxy.drop_every_write(False)
                await asyncio.wait_for(asyncio.gather(*calls), 60)
            print(
                f"replies lost: {proxy.drops}; outcomes: {tally(ledger.entries)};",
                f"worker events_publish_failed: {len(log_events(n, 'worker', 'events_publish_failed'))}",
            )
            for e in ledger.entries:
                assert isinstance(e, Seen)
                assert not e.error, (e.error, e.details, e.request_id, len(e.indexes))
            ledger.check(accepted=5, tokens=150)  # whole, indexes 0..149, none twice
            assert all(isinstance(e, Seen) and e.completion_tokens == 150 for e in ledger.entries), ledger.entries
            # the faults really happened: lost replies, after each the worker reconnected and wrote again
            assert proxy.drops > 3, proxy.drops
            assert proxy.connections > proxy.connections_at_drop[0], (proxy.connections, proxy.connections_at_drop)
            assert log_events(n, "worker", "events_publish_failed")
            await no_pending(n, 15)
    finally:
        proxy.close()


# ---- 2. Redis back from its AOF without the last second of writes -------------------------------


def appendonly_dir(server: RedisProcess) -> Path:
    d = server.dir / "appendonlydir"  # Redis 7: base + incremental files and a manifest
    assert d.is_dir(), sorted(p.name for p in server.dir.iterdir())
    return d


async def batch_ended(stub: batch_pb2_grpc.BatchServiceStub, batch_id: str, timeout_s: float) -> bpb.Batch:
    """GetBatch until the batch is in an end state (riding out UNAVAILABLE while Redis comes back)."""
    ended = (bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_CANCELLED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_FAILED)
    last: list[bpb.Batch] = []  # the last batch read: an error while Redis is out keeps it

    async def batch() -> bpb.Batch | None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            last[:] = [await stub.GetBatch(bpb.GetBatchRequest(batch_id=batch_id), timeout=5)]
        return last[0] if last else None

    got = await until(
        batch, timeout_s, f"batch {batch_id} to end", done=lambda b: b is not None and b.state in ended, poll_s=0.2
    )
    assert got is not None
    return got


async def test_redis_back_without_its_last_second_of_writes(aof_redis: RedisProcess, tmp_path: Path) -> None:
    """With 15 streams and a batch of 8 items running, the AOF is copied (time T); a second of
    writes later Redis is killed (-9) and restarted on the copy: the events, acks and batch results
    written after T are gone (5 streams and the batch's items end in that second). Each stream
    completes whole (one whose next events were lost resumes from what its caller has); none gets
    a token twice.
    The batch ends with one result per item, and no job is left pending."""
    env = {**FAST, "LLAMAMESH_BATCH_CLAIM_IDLE_S": "3", "LLAMAMESH_BATCH_SWEEP_INTERVAL_S": "1"}
    ledger = FaultLedger()
    items = [
        bpb.BatchItem(
            custom_id=f"item-{i}", request=pb.GenerateRequest(prompt=f"batch item {i}", max_tokens=30, ignore_eos=True)
        )
        for i in range(8)
    ]
    with started(aof_redis, tmp_path / "node", env) as n:
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            batches = batch_pb2_grpc.BatchServiceStub(ch)
            calls = await ledger.open_streams(stub, 10, 100)  # 5 s each
            calls += await ledger.open_streams(stub, 5, 30)  # 1.5 s each: they end between T and the kill
            submitted = await batches.BatchGenerate(bpb.BatchGenerateRequest(batch_id="rewound", items=items))
            assert submitted.counts.total == 8  # its items run 1.5 s each too
            # T: a second into the long streams (~20 tokens each)
            long = ledger.entries[:10]
            await until(lambda: all(len(e.indexes) >= 20 for e in long), 30, "20 tokens each", wake=ledger.moved)
            snapshot = tmp_path / "aof-at-T"
            await asyncio.to_thread(shutil.copytree, appendonly_dir(aof_redis), snapshot)
            at_t = (ledger.tokens(), sum(c.done() for c in calls))
            batch_at_t = await batches.GetBatch(bpb.GetBatchRequest(batch_id="rewound"))
            await asyncio.sleep(1.0)  # the fault itself: a second of writes that the restart will not have
            batch_at_kill = await batches.GetBatch(bpb.GetBatchRequest(batch_id="rewound"))
            aof_redis.kill()
            lost = (ledger.tokens() - at_t[0], sum(c.done() for c in calls) - at_t[1])
            shutil.rmtree(appendonly_dir(aof_redis))
            shutil.copytree(snapshot, aof_redis.dir / "appendonlydir")
            await asyncio.to_thread(aof_redis.start)  # same port, the AOF as it was at T
            await asyncio.wait_for(asyncio.gather(*calls), 60)
            b = await batch_ended(batches, "rewound", 60)
            got = [r async for r in batches.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="rewound"))]
        print(
            f"written between T and the kill (then lost): {lost[0]} tokens delivered, {lost[1]} streams ended,",
            f"batch items succeeded {batch_at_t.counts.succeeded} -> {batch_at_kill.counts.succeeded}",
        )
        print("streams after Redis lost its last second:", tally(ledger.entries))
        statuses = [bpb.BatchItemStatus.Name(r.status) for r in got]
        print("batch:", bpb.BatchState.Name(b.state), {s: statuses.count(s) for s in sorted(set(statuses))})
        assert len(ledger.entries) == 15
        ledger.ended_once()  # nothing twice, no gap, one end each
        for e in ledger.entries:
            assert isinstance(e, Seen)
            whole = e.finish == "FINISH_REASON_LENGTH" and len(e.indexes) == e.max_tokens == e.completion_tokens
            # The contract allows UNAVAILABLE naming the lost tokens; the relay does better: an
            # attempt whose events Redis lost is resumed from what the caller has (a failover).
            assert whole, (e.finish, e.error, e.details, len(e.indexes), e.completion_tokens)
        c = b.counts
        assert c.total == 8 and c.processing == 0, b
        assert c.succeeded + c.errored + c.cancelled + c.expired == 8, b
        ids = sorted(r.custom_id for r in got)
        assert ids == sorted(f"item-{i}" for i in range(8)), ids  # one result per item: none missing, none twice
        await serves(n, wait_ready=True)
        await no_pending(n, 20)


# ---- 3. a 3-s outage with streams open and new requests arriving --------------------------------


async def test_a_three_second_redis_outage_with_new_requests_arriving(aof_redis: RedisProcess, tmp_path: Path) -> None:
    """5 streams open and a new 5-token request every 100 ms; Redis is killed (-9) and restarted
    3 s later on its AOF (fsync always: nothing lost). The open streams complete whole; requests
    refused meanwhile are UNAVAILABLE because the queue is unreachable (not a circuit open); the
    breaker never opens (the workers did not fail, Redis was out); once Redis answers again a new
    request is served within ~1 s."""
    # Probes every 0.3 s (FAST: three fail within a second of Redis going away, if they count), and
    # the breaker's default 5 s open: an opening shows in the time to serve again, as in production.
    env = {**FAST, "LLAMAMESH_BREAKER_OPEN_S": "5"}
    ledger = FaultLedger()  # the open streams
    shorts = FaultLedger()  # the new requests, accepted or refused
    with started(aof_redis, tmp_path / "node", env) as n:
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 5, 100)  # 5 s each, more with the outage
            tasks: list[asyncio.Task[Seen]] = []
            stop = asyncio.Event()

            async def arrivals() -> None:
                i = 0
                while not stop.is_set():
                    tasks.append(asyncio.create_task(shorts.generate(stub, 5, prompt=f"short {i}", timeout_s=20)))
                    i += 1
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.1)  # the pace of arrivals

            load = asyncio.create_task(arrivals())
            try:
                served_ok = lambda: sum(e.finish == "FINISH_REASON_LENGTH" for e in shorts.entries) >= 3  # noqa: E731
                await until(served_ok, 20, "new requests served before the outage", wake=shorts.moved)
                log_at_kill = len(n.log("gateway"))
                down_s = time.monotonic()
                aof_redis.kill()
                await asyncio.sleep(3.0)  # the fault itself: no Redis for 3 s
                await asyncio.to_thread(aof_redis.start)  # same port, same AOF; returns once it answers PING
                back_s = time.monotonic()
                new_ok = lambda: any(t.done() and t.result().finish and t.result().sent_s > down_s for t in tasks)  # noqa: E731
                # requests keep arriving until one sent after the kill is served (at most 15 s; if
                # none is, the recovery time below is infinite and the test fails there)
                with contextlib.suppress(TimeoutError):
                    await until(new_ok, 15, "a new request served after Redis came back", wake=shorts.moved)
            finally:
                stop.set()
                await load
            seen = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            await asyncio.wait_for(asyncio.gather(*calls), 60)
        after = [s for s in seen if s.sent_s > down_s]
        ok_after = [s for s in after if s.finish == "FINISH_REASON_LENGTH" and len(s.indexes) == 5]
        first = min(ok_after, key=lambda s: s.ended_s) if ok_after else None
        recovery_s = first.ended_s - back_s if first else float("inf")
        first_token_s = first.first_token_s - back_s if first else float("inf")
        transitions = log_events(n, "gateway", "breaker_transition", since=log_at_kill)
        opened = [e for e in transitions if e.get("new") == "open"]
        outcomes = [s.finish or f"{s.error}: {s.details}" for s in after]
        print(
            f"new requests during and after the outage: {len(after)}:",
            {o: outcomes.count(o) for o in sorted(set(outcomes))},
        )
        print(
            f"Redis back -> first new request served OK: {recovery_s:.3f} s",
            f"(its first token: {first_token_s:.3f} s); breaker openings: {len(opened)}",
        )
        print("long streams:", tally(ledger.entries))
        ledger.check(accepted=5, tokens=100)  # every open stream completed whole
        for s in seen:  # every new request: served whole, or refused because the queue is unreachable
            if s.error:
                assert s.error == "UNAVAILABLE", (s.error, s.details)
                assert "unreachable" in s.details and "circuit" not in s.details, s.details
            else:
                assert s.finish == "FINISH_REASON_LENGTH" and s.indexes == list(range(5)), s
        assert recovery_s <= 1.5, f"first new request served {recovery_s:.3f} s after Redis came back"
        assert not opened, [e.get("reason") for e in opened]
        await no_pending(n, 15)
