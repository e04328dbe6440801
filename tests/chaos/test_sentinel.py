"""A real failover of Redis under a running node: a primary, two replicas and three Sentinels
(tests/redisproc.py SentinelGroup), a gateway and a fake-engine worker reaching them through
``redis+sentinel://`` with ``LLAMAMESH_REDIS_WAIT_REPLICAS=1``.

The fault, mid-stream with a batch at work: kill -9 of the primary (the Sentinels promote a
replica within a few seconds; meanwhile nobody reaches Redis), or SENTINEL FAILOVER (the old
primary stays up, and a primary, for about 10 s: what is written there once the replica is promoted
is lost). Same ledger and invariants as test_chaos.py: every accepted stream ends exactly once
where its caller sees it, whole or with a gRPC status, its token indexes without gap or duplicate;
the batch submitted before the fault completes with every item's result exactly once; the node
serves new requests through the new primary, and nothing is left pending there.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from llamamesh.queue.keys import WORKER_GROUP, Keys, lane_batch
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.chaos.test_chaos import FAST, Ledger, serves, started
from tests.chaos.test_faults import batch_ended, tally
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisProcess, SentinelGroup
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

KIND = "redis" if shutil.which("redis-server") else "valkey"
ENV = {
    **FAST,
    "LLAMAMESH_REDIS_WAIT_REPLICAS": "1",
    "LLAMAMESH_BATCH_CLAIM_IDLE_S": "2",
    "LLAMAMESH_BATCH_SWEEP_INTERVAL_S": "1",
}
ITEMS = 24  # of 30 tokens (1.5 s each), 16 at a time (the batch share of 32 slots): two waves


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    g = SentinelGroup(KIND, tmp_path / "redis", replicas=2)
    g.start()
    yield g
    g.stop()


def pending_on(server: RedisProcess, node: ProcessNode) -> int:
    """Jobs and batch items (in the shared stream and every lane) of the node's pool leased and not
    acked, on ``server``."""
    keys = Keys(node.prefix)
    with redis.Redis(port=server.port, socket_timeout=5) as r:
        members = r.zrange(keys.batch_lanes_open(node.pool), 0, -1)
        lanes = [keys.batch_lane(node.pool, lane_batch(m.decode())) for m in members]
        streams = (keys.jobs(node.pool), keys.batch_items(node.pool), *lanes)
        return sum(int(r.xpending(s, WORKER_GROUP)["pending"]) for s in streams if r.exists(s))


@pytest.mark.parametrize("fault", ["kill -9", "SENTINEL FAILOVER"])
async def test_a_failover_of_the_primary_mid_stream(group: SentinelGroup, tmp_path: Path, fault: str) -> None:
    ledger = Ledger()
    items = [
        bpb.BatchItem(
            custom_id=f"item-{i}", request=pb.GenerateRequest(prompt=f"batch item {i}", max_tokens=30, ignore_eos=True)
        )
        for i in range(ITEMS)
    ]
    with started(group, tmp_path / "node", ENV) as n:  # type: ignore[arg-type]  # a group has .url too
        async with grpc.aio.insecure_channel(n.address) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            batches = batch_pb2_grpc.BatchServiceStub(ch)
            submitted = await batches.BatchGenerate(bpb.BatchGenerateRequest(batch_id="failover", items=items))
            assert submitted.counts.total == ITEMS
            calls = await ledger.open_streams(stub, 3, 100)  # 5 s each
            old = group.primary()
            t0 = time.monotonic()
            if fault == "kill -9":
                old.kill()
            else:
                group.failover()
            new = await asyncio.to_thread(group.wait_failover, old, 1, 30)
            moved_s = time.monotonic() - t0
            await asyncio.wait_for(asyncio.gather(*calls), 60)
            b = await batch_ended(batches, "failover", 60)
            got = [r async for r in batches.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id="failover"))]
        print(
            f"{fault}: primary {old.port} -> {new.port} in {moved_s:.1f} s; streams: {tally(ledger.entries)};",
            f"batch {bpb.BatchState.Name(b.state)} {b.counts}".replace("\n", " "),
        )
        assert len(ledger.entries) == 3
        ledger.ended_once()  # one end each, where its caller saw it; no gap, no token twice
        ledger.whole_or(100, "UNAVAILABLE")
        assert b.state == bpb.BATCH_STATE_COMPLETED and b.counts.succeeded == ITEMS and b.counts.processing == 0, b
        ids = sorted(r.custom_id for r in got)
        assert ids == sorted(f"item-{i}" for i in range(ITEMS)), ids  # every item once: none missing, none twice
        try:
            await serves(n, wait_ready=True)  # through the new primary
        except AssertionError as exc:
            raise AssertionError(f"{exc}\ngateway: {n.log('gateway')[-3000:]}\n{group.logs(3000)}") from None
        assert "worker_started" in n.log("worker") and n.procs["worker"].poll() is None  # the same worker
        await asyncio.to_thread(wait_until, lambda: pending_on(new, n) == 0, 20, "nothing pending on the new primary")
