"""A fleet on a real Redis Cluster (six redis-server processes in cluster mode: three masters with a
replica each, made by ``redis-cli --cluster create``): three gateway processes and four worker
processes on the fake engine, with the chaos ledger (every accepted request ends exactly once,
its tokens 0, 1, 2, ... with no gap or duplicate).

- N gateways x M workers: streams spread over every gateway and worker; Cancel and Attach through
  another gateway than the one that started the request; a batch submitted through one gateway and
  read through another, each item exactly once.
- kill -9 of a master mid-stream (the one holding the pool's work stream): its replica is promoted
  by the cluster, the gateway and the workers find it, and every stream completes or ends with a
  status; a batch submitted before the kill completes with each item once; new requests run.
- a live resharding mid-stream: the slot of the pool's work stream and those of every event shard
  move to other masters key by key (ASK, TRYAGAIN, then MOVED) while streams run and new ones start:
  every stream completes whole, and the batch loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llamamesh.queue.keys import Keys
from llamamesh.queue.slots import shard_tags
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.chaos.test_chaos import FAST, Ledger
from tests.e2e.conftest import ProcessNode
from tests.redisproc import RedisClusterProcs, free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


class Fleet(ProcessNode):
    """``gateways`` gateway processes and ``workers`` worker processes sharing one cluster."""

    def __init__(self, workdir: Path, cluster: RedisClusterProcs, gateways: int, workers: int) -> None:
        super().__init__(workdir, cluster, engine="fake", extra_env=FAST)  # type: ignore[arg-type]
        self.ports = [self.port] + [free_port() for _ in range(gateways - 1)]
        self.workers = workers

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self, timeout_s: float = 120.0) -> None:
        for i, port in enumerate(self.ports):
            self.spawn(f"gateway-{i}", "services", LLAMAMESH_GATEWAY_PORT=str(port))
        for j in range(self.workers):
            self.spawn(f"worker-{j}", "workers", LLAMAMESH_WORKER_CONSUMER=f"cluster-w{j}")
        from llamamesh.client import serving

        for address in self.addresses():
            wait_until(lambda a=address: serving(a, f"llamamesh.backend.{self.pool}"), timeout_s, f"{address} ready")
        for j in range(self.workers):
            wait_until(lambda j=j: '"worker_started"' in self.log(f"worker-{j}"), timeout_s, f"worker {j}")

    def jobs_by_worker(self) -> Counter[str]:
        workers = [name for name in self.procs if name.startswith("worker")]
        return Counter({name: self.log(name).count('"job_finished"') for name in workers})


@contextlib.contextmanager
def fleet(tmp_path: Path, cluster: RedisClusterProcs, gateways: int, workers: int) -> Iterator[Fleet]:
    f = Fleet(tmp_path, cluster, gateways, workers)
    try:
        f.start()
        yield f
    finally:
        f.stop()


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    with RedisClusterProcs(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def documents(batch_id: str, n: int) -> bpb.BatchGenerateRequest:
    return bpb.BatchGenerateRequest(
        batch_id=batch_id,
        summarise=bpb.Summarise(
            documents=[bpb.Document(custom_id=f"doc-{i}", text=f"document {i} about harbour {i}") for i in range(n)],
            params=pb.GenerateRequest(max_tokens=8),
        ),
    )


async def batch_results(stub: batch_pb2_grpc.BatchServiceStub, batch_id: str, timeout_s: float) -> Counter[str]:
    """custom_id -> how many results the batch's stream gave for it (the stream ends with the batch)."""
    got: Counter[str] = Counter()

    async def read() -> None:
        async for r in stub.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id=batch_id)):
            got[r.custom_id] += 1

    await asyncio.wait_for(read(), timeout_s)  # asyncio.timeout is 3.11+; the code supports 3.10
    return got


async def test_three_gateways_and_four_workers_share_one_cluster(cluster: RedisClusterProcs, tmp_path: Path) -> None:
    with fleet(tmp_path, cluster, gateways=3, workers=4) as f:
        channels = [grpc.aio.insecure_channel(a) for a in f.addresses()]
        stubs = [pb_grpc.GenerationServiceStub(ch) for ch in channels]
        batches = [batch_pb2_grpc.BatchServiceStub(ch) for ch in channels]
        try:
            # Streams over every gateway at once: each ends once, whole.
            ledger = Ledger()
            await asyncio.wait_for(asyncio.gather(*(ledger.stream(stubs[i % 3], 20, None) for i in range(60))), 120)
            ledger.check(accepted=60, tokens=20)
            # A worker logs a job's end just after its last token went out: every line, then who ran them.
            await asyncio.to_thread(wait_until, lambda: f.jobs_by_worker().total() >= 60, 10, "60 jobs logged")
            assert all(n > 0 for n in f.jobs_by_worker().values()), f.jobs_by_worker()

            # Cancel through another gateway than the one streaming.
            call = stubs[0].Generate(
                pb.GenerateRequest(request_id="cancel-me", prompt="go on", max_tokens=2000, ignore_eos=True)
            )
            first = await call.read()
            await stubs[1].Cancel(pb.CancelRequest(request_id="cancel-me"))
            last = first
            while (m := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
                last = m
            assert last.finish_reason == pb.FINISH_REASON_CANCELLED

            # Attach through a third gateway from the tokens the caller has.
            call = stubs[1].Generate(
                pb.GenerateRequest(
                    request_id="move-me", prompt="keep going", max_tokens=60, ignore_eos=True, resumable=True
                )
            )
            have: list[int] = []
            while len(have) < 10:
                have += (await call.read()).token_ids
            call.cancel()  # the caller's connection drops; the resumable request runs on
            indexes: list[int] = []
            finish = 0
            async for m in stubs[2].Attach(pb.AttachRequest(request_id="move-me", offset=len(have))):
                indexes += range(m.index, m.index + len(m.token_ids))
                finish = m.finish_reason or finish
            assert indexes == list(range(len(have), 60)) and finish == pb.FINISH_REASON_LENGTH

            # A batch submitted through one gateway, its results read through another.
            await batches[0].BatchGenerate(documents("fleet-batch", 24))
            got = await batch_results(batches[2], "fleet-batch", 120)
            assert got == Counter({f"doc-{i}": 1 for i in range(24)})
        finally:
            for ch in channels:
                await ch.close()


async def test_kill_minus_nine_of_a_master_mid_stream(cluster: RedisClusterProcs, tmp_path: Path) -> None:
    with fleet(tmp_path, cluster, gateways=1, workers=2) as f:
        async with grpc.aio.insecure_channel(f.address) as ch:
            stub, batches = pb_grpc.GenerationServiceStub(ch), batch_pb2_grpc.BatchServiceStub(ch)
            await batches.BatchGenerate(documents("before-the-kill", 16))
            ledger = Ledger()
            calls = await ledger.open_streams(stub, 20, tokens=120)  # ~6 s each at 0.05 s a step
            killed = cluster.kill_master(Keys(f.prefix).jobs(f.pool))
            await asyncio.to_thread(cluster.wait_ok, 30)  # its replica took over
            await asyncio.wait_for(asyncio.gather(*calls), 120)
            ledger.ended_once()
            # Each stream completed, or ended with a status (never silently cut, never duplicated).
            for e in ledger.entries:
                assert (e.finish == "FINISH_REASON_LENGTH" and len(e.indexes) == 120) or e.error, e
            # New requests run on the promoted replica, and the batch lost nothing.
            after = Ledger()
            await asyncio.wait_for(asyncio.gather(*(after.stream(stub, 5, None) for _ in range(4))), 60)
            after.check(accepted=4, tokens=5)
            got = await batch_results(batches, "before-the-kill", 120)
            assert got == Counter({f"doc-{i}": 1 for i in range(16)}), got
        assert killed.proc is None
        for name, p in f.procs.items():  # nobody died of it
            assert p.poll() is None, (name, f.log(name)[-2000:])


async def test_slots_move_to_another_master_mid_stream(cluster: RedisClusterProcs, tmp_path: Path) -> None:
    """A resharding (``redis-cli --cluster reshard``'s steps, one key at a time) of the slot of the
    pool's work stream and of every event shard while streams run and new ones start: clients follow
    ASK, TRYAGAIN and then MOVED, and moving slots is not a fault: every stream completes whole."""
    with fleet(tmp_path, cluster, gateways=2, workers=2) as f:
        channels = [grpc.aio.insecure_channel(a) for a in f.addresses()]
        stubs = [pb_grpc.GenerationServiceStub(ch) for ch in channels]
        batches = batch_pb2_grpc.BatchServiceStub(channels[0])
        try:
            await batches.BatchGenerate(documents("before-the-move", 16))
            ledger = Ledger()
            calls = await ledger.open_streams(stubs[0], 20, tokens=120)  # ~6 s each at 0.05 s a step
            keys = Keys(f.prefix)
            moving = [keys.jobs(f.pool)] + [f"{{{tag}}}" for tag in shard_tags(keys.event_shards)]
            before = {k: cluster.master_of(k).port for k in moving}
            move = asyncio.create_task(asyncio.to_thread(lambda: [cluster.migrate_slot(k, 0.02) for k in moving]))
            during = [asyncio.create_task(ledger.stream(stubs[1], 30, None)) for _ in range(10)]
            await asyncio.wait_for(move, 90)
            await asyncio.wait_for(asyncio.gather(*calls, *during), 120)
            assert all(cluster.master_of(k).port != port for k, port in before.items())
            ledger.ended_once()
            assert len(ledger.entries) == 30
            for e in ledger.entries:
                assert not e.error and e.finish == "FINISH_REASON_LENGTH" and len(e.indexes) in (30, 120), e
            # After the move: new requests, and the batch submitted before it, each item once.
            after = Ledger()
            await asyncio.wait_for(asyncio.gather(*(after.stream(stubs[i % 2], 5, None) for i in range(4))), 60)
            after.check(accepted=4, tokens=5)
            got = await batch_results(batches, "before-the-move", 120)
            assert got == Counter({f"doc-{i}": 1 for i in range(16)}), got
        finally:
            for ch in channels:
                await ch.close()
        for name, p in f.procs.items():  # nobody died of it
            assert p.poll() is None, (name, f.log(name)[-2000:])
