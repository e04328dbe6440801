"""Workers spanning the GPUs of one host (marker gpu; needs two CUDA devices, vLLM and a model folder).

- one worker, tensor_parallel_size 2: one engine sharded over both GPUs;
- tensor_parallel_size 1: one worker process per GPU (workers/replicas.py), both leasing from the pool.

The model is a Llama-3.1-8B-shaped folder (random weights: ``load_format dummy``; ``bench/model_dir.py``
makes one) named by ``E2E_MULTI_GPU_MODEL``; without one the tests skip. Text from random weights
means nothing, so these tests assert streaming, token counts, cancellation, health and where the
work ran, not content. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), which hosts
without NVLink multicast support need.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llamamesh.client import Client
from llamamesh.v1 import admin_pb2, admin_pb2_grpc
from tests.e2e.conftest import ProcessNode, _cuda_and_vllm
from tests.redisproc import RedisProcess
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.gpu, pytest.mark.timeout(600)]

MODEL = os.environ.get("E2E_MULTI_GPU_MODEL", "/tmp/vllmdev/model/llama8b-dummy")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _two_gpus() -> str | None:
    why = _cuda_and_vllm()
    if why is not None:
        return why
    import torch

    if torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} CUDA device(s), this needs 2"
    if not Path(MODEL, "config.json").is_file():
        return f"no model folder at {MODEL}"
    return None


def gpu_memory_used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [int(x) for x in out.split()]


@pytest.fixture(scope="module", params=["tp2", "two workers"])
def node(
    request: pytest.FixtureRequest, e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNode]:
    """One node per layout, shared by the module's tests (the replica-killing test runs last)."""
    why = _two_gpus()
    if why is not None:
        pytest.skip(why)
    tp = "2" if request.param == "tp2" else "1"
    n = ProcessNode(
        tmp_path_factory.mktemp("multi-gpu"),
        e2e_redis,
        engine="vllm",
        pool="gpu",
        extra_env={
            **NO_MULTICAST,
            "CUDA_VISIBLE_DEVICES": "0,1",
            "LLAMAMESH_GATEWAY_MODELS": "llama8b-dummy=gpu",
            "LLAMAMESH_WORKER_MODEL": "llama8b-dummy",
            "LLAMAMESH_WORKER_MODEL_PATH": MODEL,
            "LLAMAMESH_WORKER_MAX_INFLIGHT": "128",
            "LLAMAMESH_VLLM_LOAD_FORMAT": "dummy",
            "LLAMAMESH_VLLM_MAX_MODEL_LEN": "4096",
            "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE": tp,
            "LLAMAMESH_VLLM_FRONTENDS": "2",
            "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": "0.5",
            "LLAMAMESH_VLLM_ENFORCE_EAGER": "true",  # start-up without a minute of torch.compile
        },
    )
    n.param = request.param  # type: ignore[attr-defined]
    try:
        n.start(timeout_s=480)
        frontends = 2 if tp == "2" else 4  # every frontend of every replica leasing
        n._wait(lambda: n.log("worker").count('"worker_started"') >= frontends, time.monotonic() + 300, "all frontends")
        yield n
    finally:
        n.stop()


async def _workers(address: str, want: int) -> list[str]:
    """The pool's live workers as the gateway lists them, once it lists ``want`` (or after 60 s):
    a replica that started last may not have reached the gateway's view yet."""
    async with grpc.aio.insecure_channel(address) as ch:

        async def names() -> list[str]:
            got = await admin_pb2_grpc.AdminServiceStub(ch).ListBackends(admin_pb2.ListBackendsRequest())
            return sorted(w.name for b in got.backends if b.pool == "gpu" for w in b.workers)

        try:
            return await until(names, 60, f"{want} workers listed", done=lambda got: len(got) >= want, poll_s=0.2)
        except TimeoutError:
            return await names()  # the callers' assertions say what is missing


async def test_streams_on_both_gpus(node: ProcessNode) -> None:
    used = gpu_memory_used_mib()
    assert len(used) >= 2 and all(u > 8 * 1024 for u in used[:2]), used  # weights or KV cache on each GPU
    log = node.log("worker")
    if node.param == "tp2":  # type: ignore[attr-defined]
        assert '"tensor_parallel_size": 2' in log
        assert await _workers(node.address, 2) == ["e2e-worker-0", "e2e-worker-1"]  # one engine, two frontends
    else:
        assert log.count('"replica_started"') == 2 and '"tensor_parallel_size": 1' in log
        names = await _workers(node.address, 4)
        assert names == ["e2e-worker-r0-0", "e2e-worker-r0-1", "e2e-worker-r1-0", "e2e-worker-r1-1"], names

    async with Client(node.address) as c:

        async def one(i: int) -> tuple[int, int]:
            msgs = [m async for m in c.generate(prompt=f"request {i}: tell a story", max_tokens=64, ignore_eos=True)]
            return sum(len(m.token_ids) for m in msgs), msgs[-1].usage.completion_tokens

        try:
            got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 300)
        except grpc.aio.AioRpcError as exc:  # say why the pool failed, from both sides
            tail = "\n".join(node.log(p)[-3000:] for p in ("gateway", "worker"))
            raise AssertionError(f"{exc.code()}: {exc.details()}\n{tail}") from exc
    assert got == [(64, 64)] * 64
    if node.param == "two workers":  # type: ignore[attr-defined]
        # both replicas took work: each logs the jobs it finished under its own consumer name, just
        # after its last token went out (so the callers may be first: every line, then who ran them)
        def finished() -> list[str]:
            return [line for line in node.log("worker").splitlines() if '"job_finished"' in line]

        await until(lambda: len(finished()) >= 64, 10, "64 jobs logged")
        for replica in ("r0", "r1"):
            assert any(f'"e2e-worker-{replica}-' in line for line in finished()), replica


async def test_cancel_mid_stream_frees_the_slot(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        stream = c.generate(prompt="a long story", max_tokens=2000, ignore_eos=True)
        seen = 0
        async for m in stream:
            seen += len(m.token_ids)
            if seen >= 8:
                break
        await stream.aclose()  # type: ignore[attr-defined]  # the client cancels the call
    async with Client(node.address) as c:  # the engine still serves
        msgs = [m async for m in c.generate(prompt="hi", max_tokens=8, ignore_eos=True)]
    assert sum(len(m.token_ids) for m in msgs) == 8


def test_a_dead_replica_is_started_again_while_the_other_serves(node: ProcessNode) -> None:
    if node.param != "two workers":  # type: ignore[attr-defined]
        pytest.skip("replicas only")
    sup = node.procs["worker"]

    def replicas() -> list[str]:
        kids = subprocess.run(["pgrep", "-P", str(sup.pid)], capture_output=True, text=True).stdout.split()
        return [k for k in kids if "workers" in Path(f"/proc/{k}/cmdline").read_text(errors="replace")]

    first = replicas()
    assert len(first) == 2
    os.kill(int(first[0]), signal.SIGKILL)
    wait_until(lambda: (now := replicas()) and len(now) == 2 and first[0] not in now, 60, "replica 0 again")
    assert sup.poll() is None  # the set goes on: only the dead replica is restarted
    wait_until(lambda: node.log("worker").count('"worker_started"') >= 6, 300, "the new replica's two frontends ready")
