"""Durable batches with real processes: redis-server, the gateway, worker processes running the real
SmolLM2-135M-Instruct on the CPU; faults are kill -9 of a worker and a Redis restart with AOF
(graceful, and kill -9 of Redis: the last second of writes may be lost and must be redone)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis

from llamamesh.client import field_violations
from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENV = {
    "LLAMAMESH_WORKER_THREADS": "1",
    "LLAMAMESH_WORKER_MAX_INFLIGHT": "8",
    "LLAMAMESH_WORKER_HEARTBEAT_S": "0.5",
    "LLAMAMESH_BATCH_CLAIM_IDLE_S": "3",
    "LLAMAMESH_BATCH_SWEEP_INTERVAL_S": "1",
    "LLAMAMESH_BATCH_FAIL_AFTER": "3",
}
DOCS = [
    f"Document {i}: the harbour town of Port {chr(65 + i)} grew around its fish market, and in year {1900 + i} "
    f"it built a lighthouse that still guides {i + 3} boats home every night."
    for i in range(20)
]


def summarise(batch_id: str, n: int = 20, max_tokens: int = 12, **kw: object) -> bpb.BatchGenerateRequest:
    return bpb.BatchGenerateRequest(
        batch_id=batch_id,
        summarise=bpb.Summarise(
            documents=[bpb.Document(custom_id=f"doc-{i}", text=DOCS[i % len(DOCS)]) for i in range(n)],
            params=pb.GenerateRequest(max_tokens=max_tokens, temperature=0.0),
        ),
        **kw,  # type: ignore[arg-type]
    )


def make_node(redis: RedisProcess, tmp_path: Path) -> ProcessNode:
    return ProcessNode(tmp_path, redis, engine="transformers", extra_env=ENV)


def running(redis: RedisProcess, workdir: Path) -> Iterator[ProcessNode]:
    n = make_node(redis, workdir)
    try:
        n.start()
        yield n
    finally:
        n.stop()


@pytest.fixture(scope="module")
def shared(e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessNode]:
    """One node for the tests that kill or stop nothing of it (each uses batch ids of its own)."""
    yield from running(e2e_redis, tmp_path_factory.mktemp("batch-node"))


@pytest.fixture
def node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    """A node of the test's own, for a test that kills a part of it."""
    yield from running(e2e_redis, tmp_path)


@pytest_asyncio.fixture
async def stub(shared: ProcessNode) -> AsyncIterator[batch_pb2_grpc.BatchServiceStub]:
    async with grpc.aio.insecure_channel(shared.address) as ch:
        yield batch_pb2_grpc.BatchServiceStub(ch)


ENDED = (bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_CANCELLED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_FAILED)


async def until_ended(stub: batch_pb2_grpc.BatchServiceStub, batch_id: str, timeout_s: float) -> bpb.Batch:
    return await batch_until(stub, batch_id, lambda b: b.state in ENDED, timeout_s)


async def batch_until(
    stub: batch_pb2_grpc.BatchServiceStub, batch_id: str, done: Callable[[bpb.Batch], bool], timeout_s: float
) -> bpb.Batch:
    """GetBatch until ``done`` holds of the batch (another process's progress); fails showing the last seen."""
    get = lambda: stub.GetBatch(bpb.GetBatchRequest(batch_id=batch_id))  # noqa: E731
    return await until(get, timeout_s, f"batch {batch_id}", done=done, poll_s=0.2)


def assert_counts(b: bpb.Batch) -> None:
    c = b.counts
    assert c.processing + c.succeeded + c.errored + c.cancelled + c.expired == c.total, c


async def results(stub: batch_pb2_grpc.BatchServiceStub, batch_id: str, cursor: str = "") -> list[bpb.BatchResult]:
    return [r async for r in stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id=batch_id, cursor=cursor))]


def one_each(got: list[bpb.BatchResult], n: int) -> None:
    ids = [r.custom_id for r in got]
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(n)), ids  # none missing, none twice


async def test_twenty_documents_summarised_one_result_each(stub: batch_pb2_grpc.BatchServiceStub) -> None:
    submitted = await stub.BatchGenerate(summarise("twenty"))
    assert submitted.state == bpb.BATCH_STATE_IN_PROGRESS and submitted.counts.total == 20
    again = await stub.BatchGenerate(summarise("twenty"))  # idempotent on batch_id
    assert again.batch_id == "twenty" and again.created_at == submitted.created_at
    got = await asyncio.wait_for(results(stub, "twenty"), 180)  # streamed as items finish, until the end
    one_each(got, 20)
    assert all(r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED and r.text.strip() for r in got)
    assert all(r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 30 for r in got)
    b = await stub.GetBatch(bpb.GetBatchRequest(batch_id="twenty"))
    assert b.state == bpb.BATCH_STATE_COMPLETED and b.counts.succeeded == 20
    assert_counts(b)
    # the batch's usage: its items' own, each once
    assert b.usage.completion_tokens == 20 * 12 and b.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in got)
    assert b.usage.total_tokens == b.usage.prompt_tokens + b.usage.completion_tokens
    assert b.in_progress_at.seconds and b.completed_at.ToNanoseconds() >= b.in_progress_at.ToNanoseconds()
    # resumable: from the 10th result's cursor, the other ten
    rest = await results(stub, "twenty", cursor=got[9].cursor)
    assert [r.custom_id for r in rest] == [r.custom_id for r in got[10:]]
    listed = await stub.ListBatches(bpb.ListBatchesRequest(page_size=10))
    assert "twenty" in [x.batch_id for x in listed.batches]
    # another tenant sees none of it
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.GetBatch(bpb.GetBatchRequest(batch_id="twenty"), metadata=(("x-llamamesh-tenant", "other"),))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


async def test_bad_batches_are_rejected_with_nothing_queued(stub: batch_pb2_grpc.BatchServiceStub) -> None:
    dup = summarise("dup", n=3)
    dup.summarise.documents[2].custom_id = "doc-0"
    cases = [
        (dup, "summarise.documents[2].custom_id"),
        (bpb.BatchGenerateRequest(batch_id="empty"), "items"),
        (summarise("window", n=2, completion_window_s=1), "completion_window_s"),
        (
            bpb.BatchGenerateRequest(
                batch_id="bad-item",
                items=[
                    bpb.BatchItem(custom_id="a", request=pb.GenerateRequest(prompt="hi", max_tokens=2)),
                    bpb.BatchItem(custom_id="b", request=pb.GenerateRequest(prompt="hi", temperature=-1)),
                ],
            ),
            "items[1].request.temperature",
        ),
        (
            bpb.BatchGenerateRequest(
                batch_id="bad-schema",
                items=[
                    bpb.BatchItem(
                        custom_id="a",
                        request=pb.GenerateRequest(
                            prompt="hi", response_format=pb.ResponseFormat(json_schema="{not json")
                        ),
                    ),
                ],
            ),
            "items[0].request.response_format.json_schema",
        ),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.BatchGenerate(request)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value
        assert field in field_violations(exc.value), exc.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetBatch(bpb.GetBatchRequest(batch_id=request.batch_id))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was stored


async def test_cancel_mid_batch(stub: batch_pb2_grpc.BatchServiceStub) -> None:
    await stub.BatchGenerate(summarise("cancel-me", n=20, max_tokens=24))
    stream = aiter(stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="cancel-me")))
    first = await asyncio.wait_for(anext(stream), 120)
    cancelling = await stub.CancelBatch(bpb.CancelBatchRequest(batch_id="cancel-me"))
    assert cancelling.state in (bpb.BATCH_STATE_CANCELLING, bpb.BATCH_STATE_CANCELLED)
    got = [first] + [r async for r in stream]
    b = await until_ended(stub, "cancel-me", 120)
    assert b.state == bpb.BATCH_STATE_CANCELLED
    assert_counts(b)
    assert b.counts.processing == 0 and b.counts.succeeded >= 1 and b.counts.cancelled >= 1
    assert b.counts.succeeded + b.counts.cancelled == 20
    one_each(got, 20)
    # the in-flight ones finished (succeeded), the queued ones were cancelled unrun
    assert {r.status for r in got} == {bpb.BATCH_ITEM_STATUS_SUCCEEDED, bpb.BATCH_ITEM_STATUS_CANCELLED}


async def test_kill_minus_nine_of_a_worker_mid_batch(node: ProcessNode) -> None:
    node.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = batch_pb2_grpc.BatchServiceStub(ch)
        await stub.BatchGenerate(summarise("killed", n=20, max_tokens=24))
        stream = aiter(stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="killed")))
        got = [await asyncio.wait_for(anext(stream), 120)]
        node.procs["worker"].send_signal(signal.SIGKILL)  # its running items stay leased to it
        node.procs["worker"].wait(10)
        got += [r async for r in stream]
        b = await until_ended(stub, "killed", 180)
        assert b.state == bpb.BATCH_STATE_COMPLETED and b.counts.succeeded == 20
        assert_counts(b)
        one_each(got, 20)
        # the items the dead worker ran again count once: the batch's tokens are its results' own
        assert b.usage.completion_tokens == sum(r.usage.completion_tokens for r in got) > 0
        assert '"batch_item_finished"' in node.log("worker2")


@pytest.mark.parametrize("stop", ["graceful", "kill -9"])
async def test_redis_restart_with_aof_loses_nothing(tmp_path: Path, stop: str) -> None:
    redis = RedisProcess("redis" if shutil.which("redis-server") else "valkey", tmp_path / "redis", appendonly=True)
    redis.start()
    (tmp_path / "node").mkdir()
    node = make_node(redis, tmp_path / "node")
    try:
        node.start()
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = batch_pb2_grpc.BatchServiceStub(ch)
            await stub.BatchGenerate(summarise("aof", n=12, max_tokens=12))
            first = await asyncio.wait_for(
                stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="aof")).read(), 120
            )
            assert first.custom_id
            redis.stop() if stop == "graceful" else redis.kill()
            redis.start()  # same port, same AOF file
            try:
                b = await asyncio.wait_for(_until_ended_retrying(stub, "aof"), 180)
            except (TimeoutError, asyncio.TimeoutError):
                print(_batch_stream_state(node, "aof"))  # shown with the failure
                raise
            assert b.state == bpb.BATCH_STATE_COMPLETED and b.counts.succeeded == 12, b
            assert_counts(b)
            one_each(await results(stub, "aof"), 12)
    finally:
        node.stop()
        redis.stop()


def _batch_stream_state(node: ProcessNode, batch_id: str) -> str:
    """What Redis holds for a batch that did not end: its record, its items' group and who holds them."""
    r = redis.Redis.from_url(node.redis.url)
    keys = Keys(node.prefix)
    stream = keys.batch_items(node.pool)
    try:
        there = r.exists(stream)
        return "\n".join(
            f"{what}: {value!r}"
            for what, value in [
                ("record", r.hgetall(keys.batch(batch_id))),
                ("started", r.smembers(keys.batch_started(batch_id))),
                ("done", r.hgetall(keys.batch_done(batch_id))),
                ("stream length", r.xlen(stream)),
                ("groups", r.xinfo_groups(stream) if there else None),
                ("consumers", r.xinfo_consumers(stream, WORKER_GROUP) if there else None),
                ("pending", r.xpending_range(stream, WORKER_GROUP, "-", "+", 100) if there else None),
            ]
        )
    except redis.RedisError as exc:
        return f"(Redis state unreadable: {exc!r})"
    finally:
        r.close()


async def _until_ended_retrying(stub: batch_pb2_grpc.BatchServiceStub, batch_id: str) -> bpb.Batch:
    """Like until_ended, riding out UNAVAILABLE while Redis comes back."""

    async def batch() -> bpb.Batch | None:
        try:
            return await stub.GetBatch(bpb.GetBatchRequest(batch_id=batch_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None  # Redis restarting

    got = await until(
        batch, 170, f"batch {batch_id} to end", done=lambda b: b is not None and b.state in ENDED, poll_s=0.2
    )
    assert got is not None
    return got


@pytest.mark.timeout(200)
async def test_a_twenty_second_window_ends_every_item_with_no_worker_left(node: ProcessNode) -> None:
    """The only worker dies (kill -9) holding items it started; nobody runs the rest. Once the 20 s
    window has passed, the gateway's sweeper ends all of them expired: the unstarted ones, and the
    started ones the dead worker left leased (untouched for the 3 s claim idle time)."""
    r = redis.Redis.from_url(node.redis.url)
    keys = Keys(node.prefix)
    try:
        async with grpc.aio.insecure_channel(node.address) as ch:
            stub = batch_pb2_grpc.BatchServiceStub(ch)
            b = await stub.BatchGenerate(summarise("window", n=6, max_tokens=1000, completion_window_s=20))
            assert b.expires_at.seconds - b.created_at.seconds == 20
            wait_until(lambda: r.scard(keys.batch_started("window")) >= 1, 60, "the worker to start items")
            node.procs["worker"].send_signal(signal.SIGKILL)  # its started items stay leased to it
            node.procs["worker"].wait(10)
            started = r.scard(keys.batch_started("window"))
            assert 1 <= started < 6, started  # some ran when it died, some never started
            # No worker: the gateway's sweeper ends the batch once the window has passed.
            b = await until_ended(stub, "window", 90)
            assert b.state == bpb.BATCH_STATE_EXPIRED and b.counts.expired == 6
            assert b.expired_at.seconds >= b.expires_at.seconds
            assert_counts(b)
            got = await results(stub, "window")
            assert {r.status for r in got} == {bpb.BATCH_ITEM_STATUS_EXPIRED}
            assert sum("worker was gone" in r.error_message for r in got) == started
            one_each(got, 6)
            # A worker that comes later drains the stale unstarted entries, with no second result.
            node.spawn("worker3", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-3")
            wait_until(lambda: r.xlen(keys.batch_items(node.pool)) == 0, 120, "the stale entries drained")
            one_each(await results(stub, "window"), 6)
    finally:
        r.close()


async def test_a_batch_whose_first_items_all_fail_ends_failed(stub: batch_pb2_grpc.BatchServiceStub) -> None:
    too_long = " ".join(["lighthouse"] * 3000)  # past the worker's max_model_len (2048): every item errors
    await stub.BatchGenerate(
        bpb.BatchGenerateRequest(
            batch_id="doomed",
            summarise=bpb.Summarise(
                documents=[bpb.Document(custom_id=f"doc-{i}", text=f"{i} {too_long}") for i in range(40)],
                params=pb.GenerateRequest(max_tokens=8),
            ),
        )
    )
    b = await until_ended(stub, "doomed", 120)
    assert b.state == bpb.BATCH_STATE_FAILED, b  # LLAMAMESH_BATCH_FAIL_AFTER=3 errors, none succeeded
    # FAILED is shown at once; its unstarted items end cancelled just after and its running ones finish
    b = await batch_until(stub, "doomed", lambda b: b.counts.processing == 0, 60)
    assert b.state == bpb.BATCH_STATE_FAILED, b
    assert b.counts.errored >= 3 and b.counts.cancelled >= 1 and b.counts.errored + b.counts.cancelled == 40
    assert_counts(b)
    got = await results(stub, "doomed")
    one_each(got, 40)
    errored = [r for r in got if r.status == bpb.BATCH_ITEM_STATUS_ERRORED]
    assert all("tokens, limit" in r.error_message for r in errored), errored[0]


SUMMARY = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "summary": {"type": "string", "maxLength": 240},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
    },
    "required": ["title", "summary", "year"],
    "additionalProperties": False,
}


def test_the_cli_summarises_documents_into_a_json_schema_every_result_valid(
    shared: ProcessNode, tmp_path: Path
) -> None:
    """`llamamesh batch submit --summarise --json-schema FILE` on the real model: each result parses and
    validates; a bad schema is refused naming the field, with nothing stored."""
    import jsonschema

    docs, schema = tmp_path / "docs.jsonl", tmp_path / "summary.schema.json"
    docs.write_text("".join(json.dumps({"custom_id": f"doc-{i}", "text": DOCS[i]}) + "\n" for i in range(5)))
    schema.write_text(json.dumps(SUMMARY))
    cli, addr = [sys.executable, "-m", "llamamesh.cli", "batch"], ["--address", shared.address]
    sub = subprocess.run(
        [
            *cli,
            "submit",
            str(docs),
            "--summarise",
            "--json-schema",
            str(schema),
            "--max-tokens",
            "120",
            "--batch-id",
            "json",
            *addr,
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert sub.returncode == 0, sub.stderr
    out = tmp_path / "out.jsonl"
    res = subprocess.run([*cli, "results", "json", "-o", str(out), *addr], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"doc-{i}" for i in range(5)]
    for r in rows:
        assert r["status"] == "succeeded" and r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), SUMMARY)
    schema.write_text('{"type": "object", "properties": ')
    bad = subprocess.run(
        [*cli, "submit", str(docs), "--summarise", "--json-schema", str(schema), "--batch-id", "bad", *addr],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    assert "summarise.params.response_format.json_schema" in bad.stderr, bad.stderr


def test_the_cli_submits_waits_and_writes_results(shared: ProcessNode, tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"custom_id": f"doc-{i}", "text": DOCS[i]}) + "\n" for i in range(5)))
    cli = [sys.executable, "-m", "llamamesh.cli", "batch"]
    addr = ["--address", shared.address]
    sub = subprocess.run(
        [*cli, "submit", str(docs), "--summarise", "--max-tokens", "8", "--batch-id", "cli", *addr],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert sub.returncode == 0, sub.stderr
    assert sub.stdout.strip() == "cli" and "5/5 completed: 5 ok" in sub.stderr  # the progress bar's last state
    assert "\r" not in sub.stderr and sub.stderr.count("5/5 completed") == 1  # not a terminal: a line per change
    out = tmp_path / "out.jsonl"
    res = subprocess.run([*cli, "results", "cli", "-o", str(out), *addr], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"doc-{i}" for i in range(5)]
    assert all(r["status"] == "succeeded" and r["usage"]["completion_tokens"] == 8 and r["text"] for r in rows)
    status = subprocess.run([*cli, "status", "cli", *addr], capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["state"] == "BATCH_STATE_COMPLETED"
    bad = subprocess.run([*cli, "status", "nope", *addr], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
