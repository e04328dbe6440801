"""vLLM's engine core killed under a live worker (marker gpu: skipped without CUDA and vLLM): the
worker hands back the request it was running and exits 1; with no gateway following the request
(its caller detached), the other worker claims it and carries it on in place, and the caller's
Attach gets the rest, every index once."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator

import grpc
import pytest

from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.chaos.test_carry_on import worker_of
from tests.e2e.conftest import ProcessNode, vllm_node
from tests.redisproc import RedisProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(420)]

TOKENS = 1500


@pytest.fixture
def two_workers(e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessNode]:
    """A gateway and two vLLM workers on one GPU (a fifth of its memory each), claim idle 2 s."""
    env = {
        "LLAMAMESH_VLLM_FRONTENDS": "1",
        "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": "0.2",
        "LLAMAMESH_WORKER_HEARTBEAT_S": "0.2",
        "LLAMAMESH_WORKER_HEARTBEAT_TTL_S": "1",
        "LLAMAMESH_WORKER_CLAIM_IDLE_S": "2",
    }
    node = vllm_node(tmp_path_factory.mktemp("engine-death"), e2e_redis, env)
    try:
        node.start()
        node.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
        wait_until(lambda: '"worker_started"' in node.log("worker2"), 240, "the second worker")
        yield node
    finally:
        node.stop()


def handed_back(log: str) -> list[dict[str, object]]:
    """The worker's job_handed_back lines (vLLM's own lines in the log are not JSON)."""
    lines = (json.loads(x) for x in log.splitlines() if x.startswith('{"') and '"job_handed_back"' in x)
    return [e for e in lines if e.get("event") == "job_handed_back"]


async def test_a_detached_request_whose_engine_core_is_killed_is_carried_on(two_workers: ProcessNode) -> None:
    import psutil  # vLLM's own dependency

    node = two_workers
    rid = "engine-core-killed"
    request = pb.GenerateRequest(
        request_id=rid, prompt="Count from one to a thousand:", max_tokens=TOKENS, ignore_eos=True, resumable=True
    )
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        call = stub.Generate(request)
        got: list[int] = []
        while len(got) < 10:
            got += (await call.read()).token_ids
        call.cancel()  # the caller leaves: no gateway follows the request now
        victim = worker_of(node, rid)
        cores = [c for c in psutil.Process(node.procs[victim].pid).children(recursive=True) if "EngineCore" in c.name()]
        assert cores, [c.name() for c in psutil.Process(node.procs[victim].pid).children(recursive=True)]
        for core in cores:
            core.send_signal(signal.SIGKILL)
        code = await asyncio.to_thread(node.procs[victim].wait, 120)
        assert code == 1, node.log(victim)[-3000:]
        back = handed_back(node.log(victim))
        assert back and back[-1]["engine_died"] is True and back[-1]["request_id"] == rid, back
        indexes: list[int] = []
        finishes = []
        async for m in stub.Attach(pb.AttachRequest(request_id=rid, offset=len(got)), timeout=240):
            indexes += range(m.index, m.index + len(m.token_ids))
            if m.finish_reason:
                finishes.append(m.finish_reason)
    assert indexes == list(range(len(got), TOKENS)) and finishes == [pb.FINISH_REASON_LENGTH]
    other = "worker2" if victim == "worker" else "worker"
    assert '"job_carried_on"' in node.log(other)
