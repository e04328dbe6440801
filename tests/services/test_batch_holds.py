"""A batch's hold on its tenant's batch budget when its BatchGenerate fails, against a real Redis:
given back when nothing was stored, kept when the batch was stored after all (the sweep gives it
back when the batch ends), so a stored batch always counts against the budget."""

from __future__ import annotations

import pytest

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.quotas import RedisQuotas
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import BatchSettings, GatewaySettings, LimitsSettings, RedisSettings
from llamamesh.tenants import Identity
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services.admission import Admission
from services.batch import BatchServicer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]

WHO = Identity("acme", "key", LimitsSettings(max_batch_items=10))


def request(batch_id: str, n: int) -> bpb.BatchGenerateRequest:
    items = [bpb.BatchItem(custom_id=f"c{i}", request=pb.GenerateRequest(prompt="p", max_tokens=2)) for i in range(n)]
    return bpb.BatchGenerateRequest(batch_id=batch_id, items=items)


async def test_a_batch_stored_though_its_call_failed_still_holds_its_items(redis_settings: RedisSettings) -> None:
    q = RedisQueue.from_settings(redis_settings)
    quotas = RedisQuotas(q.client, q.keys)
    gateway = GatewaySettings(models="tiny=cpu")

    def servicer(replicas: Replicas) -> BatchServicer:
        store = RedisBatches(q.client, q.keys, retention_s=60, replicas=replicas)
        return BatchServicer(store, gateway, BatchSettings(), gateway.model_table(), admission=Admission(quotas))

    try:
        # Sealed, then WAIT finds no replica: the call fails, the batch is stored and runs.
        with pytest.raises(QueueUnavailable, match="replicas"):
            await servicer(Replicas(count=1, timeout_ms=50)).submit(request("stored", 8), WHO)
        assert await q.client.hget(q.keys.batch("acme/stored"), "state") == b"in_progress"  # not retried
        quota = await q.client.hgetall(q.keys.tenant_batch_quota("acme"))
        assert int(quota[b"items"]) == 8  # still held: 8 of 10
        with pytest.raises(Exception, match="LLAMAMESH_LIMITS_MAX_BATCH_ITEMS"):
            await servicer(Replicas()).submit(request("more", 3), WHO)
    finally:
        await q.close()
