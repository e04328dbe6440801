"""BatchService over the in-memory queue and batch store, with a real Worker on the fake engine."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace

import grpc
import pytest
from prometheus_client import REGISTRY

from llamamesh.cli.batchfile import result_line
from llamamesh.client import field_violations
from llamamesh.settings import BatchSettings, GatewaySettings, WorkerSettings
from llamamesh.types import ItemResult, ItemStatus
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services.batch import result_pb
from tests.services.conftest import Config, Stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)

STACK = Config(
    gateway=GatewaySettings(port=0, models="tiny=cpu"),
    batches=True,
    block_ms=50,
    workers=(WorkerSettings(pool="cpu", model="tiny", engine="fake", max_inflight=4),),
    worker_batch=BatchSettings(max_share=0.5),
)


def batch(**worker: object) -> Config:
    """The batch stack, its worker's settings changed by ``worker``."""
    return replace(STACK, workers=tuple(replace(w, **worker) for w in STACK.workers))  # type: ignore[arg-type]


def items(n: int, max_tokens: int = 3) -> list[bpb.BatchItem]:
    return [
        bpb.BatchItem(custom_id=f"c{i}", request=pb.GenerateRequest(prompt=f"p {i}", max_tokens=max_tokens))
        for i in range(n)
    ]


async def test_a_batch_runs_to_completion_with_one_result_each(stack: Stack) -> None:
    stub = stack.batch
    tokens = lambda: REGISTRY.get_sample_value("llamamesh_worker_generated_tokens_total", {"pool": "cpu"}) or 0  # noqa: E731
    before = tokens()
    named = items(9)
    named[0].request.request_id = "not an id!"  # ignored, as the proto says: the server names each job
    b = await stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id="b", items=named))
    assert b.counts.total == 9 and b.counts.processing == 9
    got = [r async for r in stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="b"))]
    assert sorted(r.custom_id for r in got) == sorted(f"c{i}" for i in range(9))
    assert all(r.usage.completion_tokens == 3 and r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED for r in got)
    assert tokens() - before == 9 * 3  # the worker's throughput counts batch items too
    done = await stub.GetBatch(bpb.GetBatchRequest(batch_id="b"))
    assert done.state == bpb.BATCH_STATE_COMPLETED and done.counts.succeeded == 9 and done.counts.processing == 0
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await anext(aiter(stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="b", cursor="x"))))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(bad.value) == ["cursor"]
    page = await stub.ListBatches(bpb.ListBatchesRequest())
    assert [x.batch_id for x in page.batches] == ["b"] and page.next_page_token == ""
    # A result recorded again under a later cursor (the first lost with Redis's last second after it
    # was read, its item run again): one stream sends each item's result once.
    assert stack.batches is not None
    (stored,) = [b for key, b in stack.batches._batches.items() if key.endswith("b")]
    stored.results.append(("99999999999999-0", stored.results[0][1]))
    again = [r.custom_id async for r in stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="b"))]
    assert sorted(again) == sorted(f"c{i}" for i in range(9))


async def test_pages_of_heavily_labelled_batches_stay_small_and_list_each_once(stack: Stack) -> None:
    labels = {f"k{i}": "v" * 512 for i in range(64)}  # the most a batch may carry: about 37 KB
    for n in range(40):
        await stack.batch.BatchGenerate(bpb.BatchGenerateRequest(batch_id=f"l{n}", items=items(1), metadata=labels))
    seen: list[str] = []
    token = ""
    for _ in range(10):
        page = await stack.batch.ListBatches(bpb.ListBatchesRequest(page_size=100, page_token=token))
        assert page.ByteSize() < 2 << 20 and len(page.batches) < 40
        seen += [b.batch_id for b in page.batches]
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"l{n}" for n in reversed(range(40))]


async def test_a_duplicate_custom_id_is_rejected_and_nothing_is_stored(stack: Stack) -> None:
    stub = stack.batch
    bad = items(3)
    bad[2].custom_id = "c0"
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id="dup", items=bad))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(exc.value) == ["items[2].custom_id"]
    assert "the custom_id of items[0] too" in (exc.value.details() or ""), exc.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetBatch(bpb.GetBatchRequest(batch_id="dup"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("stack", [batch(fake_step_s=0.02)], indirect=True)
async def test_cancel_finishes_the_running_and_cancels_the_queued(stack: Stack) -> None:
    stub = stack.batch
    await stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id="c", items=items(12, max_tokens=20)))
    stream = aiter(stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="c")))
    first = await asyncio.wait_for(anext(stream), 10)
    await stub.CancelBatch(bpb.CancelBatchRequest(batch_id="c"))
    got = [first] + [r async for r in stream]
    b = await stub.GetBatch(bpb.GetBatchRequest(batch_id="c"))
    assert b.state == bpb.BATCH_STATE_CANCELLED
    assert b.counts.succeeded + b.counts.cancelled == 12 and b.counts.succeeded >= 1 and b.counts.cancelled >= 1
    assert sorted(r.custom_id for r in got) == sorted(f"c{i}" for i in range(12))
    # The proto's contract: a gRPC status code name, and the finer reason beside it.
    cancelled = [r for r in got if r.status == bpb.BATCH_ITEM_STATUS_CANCELLED]
    assert cancelled and {(r.error_code, r.error_reason) for r in cancelled} == {("CANCELLED", "CANCELLED")}
    assert all(r.error_code == "" for r in got if r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED)
    line = json.loads(result_line(cancelled[0]))
    assert line["status"] == "cancelled" and line["error"]["code"] == "CANCELLED" and line["error"]["message"]


@pytest.mark.parametrize("stack", [replace(STACK, workers=())], indirect=True)
async def test_a_batch_lost_with_redis_data_is_not_found_saying_so(stack: Stack) -> None:
    await stack.batch.BatchGenerate(bpb.BatchGenerateRequest(batch_id="kept", items=items(2)))
    assert stack.batches is not None
    stack.batches.lose_data()  # Redis came back without its data
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await stack.batch.GetBatch(bpb.GetBatchRequest(batch_id="kept"))
    assert lost.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lost with Redis's data" in (lost.value.details() or ""), lost.value.details()


def test_stored_item_errors_become_status_names() -> None:
    cases = [
        ("prompt_too_long", "INVALID_ARGUMENT"),
        ("engine_dead", "UNAVAILABLE"),
        ("expired", "DEADLINE_EXCEEDED"),
        ("internal", "INTERNAL"),
        ("no-such", "INTERNAL"),
    ]
    for stored, code in cases:
        r = result_pb("b", "1-0", ItemResult("c", ItemStatus.ERRORED, error_code=stored, error_message="m"))
        assert (r.error_code, r.error_reason) == (code, stored.upper())


async def test_items_asking_for_logprobs_get_each_samples_as_generate_does(stack: Stack) -> None:
    asked = pb.GenerateRequest(prompt="p", max_tokens=4, logprobs=2, seed=1)
    two = pb.GenerateRequest(prompt="p", max_tokens=3, n=2, temperature=0.8, logprobs=0, seed=1)
    items = [bpb.BatchItem(custom_id="lp", request=asked), bpb.BatchItem(custom_id="two", request=two)]
    items.append(bpb.BatchItem(custom_id="none", request=pb.GenerateRequest(prompt="p", max_tokens=4)))
    await stack.batch.BatchGenerate(bpb.BatchGenerateRequest(batch_id="lpb", items=items))
    got = {r.custom_id: r async for r in stack.batch.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="lpb"))}
    alone = [lp for m in [m async for m in stack.stub.Generate(asked)] for lp in m.logprobs]
    assert len(alone) == 4 and list(got["lp"].logprobs) == alone
    assert [len(s.logprobs) for s in got["two"].samples] == [3, 3]
    assert not got["two"].logprobs  # (each sample's in its own: not sample 0's twice)
    assert not got["none"].logprobs


async def test_items_with_n_samples_return_every_sample(stack: Stack) -> None:
    stub = stack.batch
    reqs = [
        bpb.BatchItem(custom_id=f"c{i}", request=pb.GenerateRequest(prompt=f"p {i}", max_tokens=4, n=3, seed=i))
        for i in range(4)
    ]
    reqs.append(bpb.BatchItem(custom_id="one", request=pb.GenerateRequest(prompt="p", max_tokens=4)))
    await stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id="nb", items=reqs))
    got = {r.custom_id: r async for r in stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="nb"))}
    for i in range(4):
        r = got[f"c{i}"]
        assert r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED and len(r.samples) == 3
        assert [s.finish_reason for s in r.samples] == [pb.FINISH_REASON_LENGTH] * 3
        assert len({s.text for s in r.samples}) == 3 and r.text == r.samples[0].text
        assert r.usage.completion_tokens == 12
    assert not got["one"].samples and got["one"].usage.completion_tokens == 4
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await stub.BatchGenerate(
            bpb.BatchGenerateRequest(
                batch_id="nb2",
                items=[bpb.BatchItem(custom_id="x", request=pb.GenerateRequest(prompt="p", n=2, temperature=0))],
            )
        )
    assert field_violations(bad.value) == ["items[0].request.n"]


@pytest.mark.parametrize("stack", [batch(adapters="sql=/adapters/sql", heartbeat_s=0.05)], indirect=True)
async def test_items_name_an_adapter_and_an_unserved_one_is_not_found_before_anything_is_stored(
    stack: Stack,
) -> None:
    stub = stack.batch

    def item(custom_id: str, adapter: str = "") -> bpb.BatchItem:
        return bpb.BatchItem(
            custom_id=custom_id,
            request=pb.GenerateRequest(prompt="same words", max_tokens=4, temperature=0, adapter=adapter),
        )

    # The gateway learns the worker's adapters from its heartbeat: until then it cannot tell (and accepts).
    attempts = itertools.count()

    async def refusal() -> tuple[grpc.aio.AioRpcError, int] | None:
        attempt = next(attempts)
        try:
            await stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id=f"p{attempt}", items=[item("x", "nope")]))
        except grpc.aio.AioRpcError as exc:
            return exc, attempt
        return None

    refused, attempt = await until(refusal, 10, "the gateway to see the worker's adapters", poll_s=0.05)
    assert refused.code() == grpc.StatusCode.NOT_FOUND, refused
    assert "items[0] ('x')" in (refused.details() or "") and "'nope'" in (refused.details() or ""), refused.details()
    with pytest.raises(grpc.aio.AioRpcError) as missing:  # nothing was stored
        await stub.GetBatch(bpb.GetBatchRequest(batch_id=f"p{attempt}"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id="ad", items=[item("base"), item("sql", "sql")]))
    got = {r.custom_id: r async for r in stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="ad"))}
    assert all(r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED for r in got.values())
    assert got["sql"].text != got["base"].text
