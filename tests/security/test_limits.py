"""Per-tenant limits on a real secured node, enforced in Redis for every gateway: each trips with
RESOURCE_EXHAUSTED and RetryInfo, queues nothing, and recovers."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llamamesh.client import Client, serving
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from tests.redisproc import RedisProcess, free_port
from tests.security.conftest import PKI
from tests.security.secured import SecuredNode, Tenants, start_node
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def limited(
    tmp_path_factory: pytest.TempPathFactory, security_redis: RedisProcess, pki: PKI
) -> Iterator[tuple[SecuredNode, Tenants]]:
    yield from start_node(
        tmp_path_factory,
        security_redis,
        pki,
        "limited",
        {
            "rps": {"limits": {"requests_per_s": 2, "burst": 2}},
            "tokens": {"limits": {"tokens_per_min": 120}},
            "detached": {"limits": {"tokens_per_min": 120}},
            "streams": {"limits": {"max_streams": 2}},
            "items": {"limits": {"max_batch_items": 5}},
            "bytes": {"limits": {"max_batch_bytes": 3000}},
            "free": {},
        },
        env={
            "LLAMAMESH_WORKER_FAKE_STEP_S": "0.01",
            "LLAMAMESH_BATCH_RETENTION_S": "2",
            "LLAMAMESH_BATCH_SWEEP_INTERVAL_S": "0.3",
        },
    )


def retry_after(err: grpc.aio.AioRpcError) -> float:
    """The RetryInfo delay of a RESOURCE_EXHAUSTED status (fails the test without one)."""
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    st = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert st is not None
    for d in st.details:
        info = error_details_pb2.RetryInfo()
        if d.Unpack(info):
            return float(info.retry_delay.ToTimedelta().total_seconds())
    raise AssertionError(f"no RetryInfo in {err}")


async def generate(c: Client, rid: str = "", **fields: object) -> list[pb.GenerateResponse]:
    return [m async for m in c.generate(request_id=rid or uuid.uuid4().hex, prompt="p", **fields)]  # type: ignore[arg-type]


def queued_ever(node: SecuredNode, security_redis: RedisProcess, tenant: str, rid: str) -> bool:
    """Whether a request id reached Redis at all (its attempts record) or a worker."""
    r = redis.Redis(port=security_redis.port)
    try:
        return bool(r.exists(f"{node.prefix}:req:{{{tenant}/{rid}}}:attempts")) or rid in node.log("worker")
    finally:
        r.close()


async def test_requests_per_second(limited: tuple[SecuredNode, Tenants], security_redis: RedisProcess) -> None:
    node, tenants = limited
    async with node.client(tenants.keys["rps"]) as c:
        await generate(c, max_tokens=1)
        await generate(c, max_tokens=1)  # the burst of 2
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(c, "refused-rps", max_tokens=1)
        wait = retry_after(exc.value)
        assert 0 < wait <= 0.5 and "LLAMAMESH_LIMITS_REQUESTS_PER_S" in (exc.value.details() or "")
        assert not queued_ever(node, security_redis, "rps", "refused-rps")

        def refused_line() -> dict | None:  # its rpc_finished line counts it on its model's pool
            lines = [json.loads(x) for x in node.log("gateway").splitlines() if '"refused-rps"' in x]
            return next((x for x in lines if x.get("event") == "rpc_finished"), None)

        await until(lambda: refused_line() is not None, 10, "the refused call's rpc_finished line")
        line = refused_line()
        assert line is not None and line["status"] == "RESOURCE_EXHAUSTED" and line["pool"], line
        await asyncio.sleep(wait)  # time passing on purpose: what RetryInfo says, then it passes
        await generate(c, max_tokens=1)
    async with node.client(tenants.keys["free"]) as other:  # another tenant's budget is its own
        for _ in range(5):
            await generate(other, max_tokens=1)


async def test_one_budget_across_gateways(limited: tuple[SecuredNode, Tenants]) -> None:
    """A second gateway process on the same Redis spends from the same bucket."""
    node, tenants = limited
    port = free_port()
    node.spawn("gateway2", "services", LLAMAMESH_GATEWAY_PORT=str(port))
    second = f"127.0.0.1:{port}"

    def second_serves() -> bool:
        assert node.procs["gateway2"].poll() is None, node.log("gateway2")[-2000:]
        return serving(second, "llamamesh.backend.cpu", tls_ca=node.ca)

    await until(second_serves, 60, "the second gateway serving", poll_s=0.1)
    await asyncio.sleep(1.0)  # time passing on purpose: a full bucket again (2 a second) after the test before
    async with node.client(tenants.keys["rps"]) as a, Client(second, api_key=tenants.keys["rps"], tls_ca=node.ca) as b:
        await generate(a, max_tokens=1)
        await generate(b, max_tokens=1)
        for c in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await generate(c, max_tokens=1)
            retry_after(exc.value)


async def test_tokens_per_minute(limited: tuple[SecuredNode, Tenants], security_redis: RedisProcess) -> None:
    node, tenants = limited
    async with node.client(tenants.keys["tokens"]) as c:
        # Within budget when it starts, it holds its 130 from then on: another is refused meanwhile.
        first = c.stub.Generate(pb.GenerateRequest(request_id=uuid.uuid4().hex, prompt="p", max_tokens=130))
        got = [await first.read()]
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(c, "refused-while-held", max_tokens=1)
        retry_after(exc.value)
        got += [m async for m in first]
        assert sum(len(m.token_ids) for m in got) == 130  # 10 tokens of debt after
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(c, "refused-tokens", max_tokens=1)
        wait = retry_after(exc.value)
        assert 4 < wait <= 6 and "LLAMAMESH_LIMITS_TOKENS_PER_MIN" in (exc.value.details() or "")
        assert not queued_ever(node, security_redis, "tokens", "refused-tokens")
        await asyncio.sleep(wait)  # time passing on purpose: what RetryInfo says, then it passes
        await generate(c, max_tokens=1)


async def test_a_resumable_request_its_caller_left_keeps_its_tokens(limited: tuple[SecuredNode, Tenants]) -> None:
    """It goes on generating for an Attach after its caller left: what it may still generate stays
    charged to the tenant (not only the tokens its first stream delivered), so leaving at once and
    reading the answer through Attach is no way round the budget."""
    node, tenants = limited
    async with node.client(tenants.keys["detached"]) as c:
        rid = uuid.uuid4().hex
        call = c.stub.Generate(pb.GenerateRequest(request_id=rid, prompt="p", max_tokens=130, resumable=True))
        await call.read()
        call.cancel()

        def detached() -> bool:
            return any("request_detached" in line and rid in line for line in node.log("gateway").splitlines())

        await until(detached, 10, "the request to be detached")
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(c, "over-budget", max_tokens=1)
        assert "LLAMAMESH_LIMITS_TOKENS_PER_MIN" in (exc.value.details() or ""), exc.value
        attached = [m async for m in c.stub.Attach(pb.AttachRequest(request_id=rid, offset=0))]
        assert sum(len(m.token_ids) for m in attached) == 130  # the answer is whole, read after all


async def test_concurrent_streams(limited: tuple[SecuredNode, Tenants], security_redis: RedisProcess) -> None:
    node, tenants = limited
    async with node.client(tenants.keys["streams"]) as c:
        held = [
            c.stub.Generate(
                pb.GenerateRequest(request_id=f"long-{i}-{uuid.uuid4().hex[:4]}", prompt="p", max_tokens=3000)
            )
            for i in range(2)
        ]
        for call in held:
            assert (await call.read()).token_ids  # both open
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(c, "refused-stream", max_tokens=1)
        assert retry_after(exc.value) > 0 and "LLAMAMESH_LIMITS_MAX_STREAMS" in (exc.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # Attach holds a stream too
            async for _m in c.stub.Attach(pb.AttachRequest(request_id="long-0")):
                pass
        retry_after(exc.value)
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # and a batch's results stream
            async for _r in c.batches.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="any")):
                pass
        assert "LLAMAMESH_LIMITS_MAX_STREAMS" in (exc.value.details() or ""), exc.value
        assert not queued_ever(node, security_redis, "streams", "refused-stream")
        held[0].cancel()

        async def served() -> bool:
            try:
                await generate(c, max_tokens=1)
            except grpc.aio.AioRpcError as err:
                retry_after(err)  # refused for want of a slot, nothing else
                return False
            return True

        await until(served, 10, "the cancelled stream's slot given back", poll_s=0.05)
        held[1].cancel()


def batch(n: int, prompt: str = "p") -> bpb.BatchGenerateRequest:
    items = [
        bpb.BatchItem(custom_id=f"i{i}", request=pb.GenerateRequest(prompt=prompt, max_tokens=2)) for i in range(n)
    ]
    return bpb.BatchGenerateRequest(batch_id=f"b-{uuid.uuid4().hex[:8]}", items=items)


async def until_accepted(c: Client, req: bpb.BatchGenerateRequest, within_s: float) -> bpb.Batch:
    """The batch once the gateway takes it (the sweep gives back what ended ones held); fails with
    the last refusal's reason."""

    async def submitted() -> bpb.Batch | str:
        try:
            return await c.batches.BatchGenerate(req)
        except grpc.aio.AioRpcError as err:
            retry_after(err)
            return err.details() or ""

    got = await until(
        submitted, within_s, "the batch to be accepted", done=lambda b: isinstance(b, bpb.Batch), poll_s=0.1
    )
    assert isinstance(got, bpb.Batch)
    return got


async def ended(c: Client, batch_id: str, within_s: float = 30) -> None:
    get = lambda: c.batches.GetBatch(bpb.GetBatchRequest(batch_id=batch_id))  # noqa: E731
    await until(
        get, within_s, f"batch {batch_id} completed", done=lambda b: b.state == bpb.BATCH_STATE_COMPLETED, poll_s=0.05
    )


async def test_batch_items_in_flight(limited: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = limited
    async with node.client(tenants.keys["items"]) as c:
        four = batch(4)
        first = await c.batches.BatchGenerate(four)
        again = await c.batches.BatchGenerate(four)
        assert again.batch_id == first.batch_id  # a resubmission holds nothing more
        refused = batch(2)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await c.batches.BatchGenerate(refused)
        assert retry_after(exc.value) > 0 and "LLAMAMESH_LIMITS_MAX_BATCH_ITEMS" in (exc.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # nothing of it was stored
            await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=refused.batch_id))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        await ended(c, first.batch_id)
        took = await until_accepted(c, refused, within_s=10)
        assert took.counts.total == 2


async def test_batch_bytes_kept(limited: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = limited
    async with node.client(tenants.keys["bytes"]) as c:
        first = await c.batches.BatchGenerate(batch(2, "x" * 900))  # ~1.9 kB of 3000
        refused = batch(2, "y" * 900)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await c.batches.BatchGenerate(refused)
        assert retry_after(exc.value) > 0 and "LLAMAMESH_LIMITS_MAX_BATCH_BYTES" in (exc.value.details() or "")
        await ended(c, first.batch_id)
        # Its bytes are held until its results expire (LLAMAMESH_BATCH_RETENTION_S, 2 s here).
        took = await until_accepted(c, refused, within_s=20)
        assert took.counts.total == 2
        # a summarisation counts its template written out for each document (what its items hold)
        docs = [bpb.Document(custom_id=f"d{i}", text="abc") for i in range(4)]
        summary = bpb.BatchGenerateRequest(summarise=bpb.Summarise(template="z" * 800 + "{document}", documents=docs))
        assert summary.ByteSize() < 1000
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await c.batches.BatchGenerate(summary)
        assert "LLAMAMESH_LIMITS_MAX_BATCH_BYTES" in (exc.value.details() or ""), exc.value.details()
