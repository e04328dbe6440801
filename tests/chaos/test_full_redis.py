"""Redis full (at its maxmemory, noeviction) under real processes: new requests and batches are
refused RESOURCE_EXHAUSTED saying why, the health service llamamesh.queue turns NOT_SERVING while
readiness stays, and the streams that were running stall, then complete whole once Redis has room
(a full Redis is an outage for writes: the workers' heartbeats expired meanwhile and they count as
lost to nobody)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import redis

from llamamesh.client import error_reason, serving
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.chaos.test_chaos import FAST, Ledger, serves, started
from tests.redisproc import RedisProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


async def test_redis_full_for_seconds_refuses_new_work_and_open_streams_complete(
    own_redis: RedisProcess, tmp_path: Path
) -> None:
    ledger = Ledger()
    with started(own_redis, tmp_path / "node", {**FAST, "LLAMAMESH_GATEWAY_HEALTH_INTERVAL_S": "0.5"}) as n:
        r = redis.Redis.from_url(own_redis.url)
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            calls = await ledger.open_streams(stub, 5, 160)  # 8 s each
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)  # every write that may grow memory is refused from now on
            try:
                await asyncio.to_thread(
                    wait_until,
                    lambda: not serving(n.address, "llamamesh.queue"),
                    10,
                    "the health service llamamesh.queue to say Redis refuses writes",
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [m async for m in stub.Generate(pb.GenerateRequest(prompt="new", max_tokens=3))]
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "Redis is full" in (refused.value.details() or "")
                assert error_reason(refused.value) == "QUEUE_OUT_OF_MEMORY"
                batches = batch_pb2_grpc.BatchServiceStub(ch)
                item = bpb.BatchItem(custom_id="a", request=pb.GenerateRequest(prompt="x", max_tokens=2))
                with pytest.raises(grpc.aio.AioRpcError) as batch_refused:
                    await batches.BatchGenerate(bpb.BatchGenerateRequest(batch_id="full", items=[item]))
                assert batch_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert serving(n.address)  # still ready: callers are told why rather than refused a connection
                await asyncio.sleep(3)  # the fault itself: longer than the workers' heartbeat TTL (0.8 s)
            finally:
                r.config_set("maxmemory", 0)
            await asyncio.wait_for(asyncio.gather(*calls), 90)
        ledger.check(accepted=5, tokens=160)  # every open stream whole, once
        await asyncio.to_thread(wait_until, lambda: serving(n.address, "llamamesh.queue"), 10, "writes taken again")
        await serves(n)
        with pytest.raises(grpc.aio.AioRpcError) as gone:  # the refused batch left nothing behind
            async with grpc.aio.insecure_channel(n.address) as ch:
                await batch_pb2_grpc.BatchServiceStub(ch).GetBatch(bpb.GetBatchRequest(batch_id="full"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        gateway_log = n.log("gateway")
        assert gateway_log.count('"queue_writes_refused"') == 1 and '"queue_writes_accepted"' in gateway_log
        r.close()
