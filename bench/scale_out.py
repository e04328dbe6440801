"""Relayed tokens/s through one gateway as fake-engine workers are added, on one redis-server and on
a Redis Cluster (six redis-server processes: three masters with a replica each), side by side in
one run.

Each configuration starts fresh processes: the Redis side, one gateway process, W worker processes
on the fake engine (``--step-s`` per engine step; 0 = no engine cost, so the serving path is all
that is measured), then a closed loop of ``--concurrency`` streaming Generate calls of
``--tokens`` tokens each for ``--seconds`` after a warm-up. Reported: tokens/s the callers
received, requests/s, and the CPU seconds each process used per 1 000 tokens (from /proc), which
shows where the limit is on a small machine.

  python bench/scale_out.py                       # docs/benchmarks.md
  python bench/scale_out.py --workers 1 2 4 8 --concurrency 128
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from llamamesh.client import serving  # noqa: E402
from llamamesh.v1 import generation_pb2 as pb  # noqa: E402
from llamamesh.v1 import generation_pb2_grpc  # noqa: E402
from tests.redisproc import RedisClusterProcs, RedisProcess, free_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@contextlib.contextmanager
def redis_side(kind: str, workdir: Path) -> Iterator[tuple[str, list[int]]]:
    server: RedisProcess | RedisClusterProcs
    server = RedisClusterProcs(workdir) if kind == "cluster" else RedisProcess("redis", workdir)
    server.start()
    try:
        nodes = server.nodes if isinstance(server, RedisClusterProcs) else [server]
        yield server.url, [n.proc.pid for n in nodes if n.proc is not None]
    finally:
        server.stop()


@contextlib.contextmanager
def fleet(url: str, workers: int, step_s: float, workdir: Path) -> Iterator[tuple[str, dict[str, int]]]:
    port = free_port()
    env = {
        **os.environ,
        "LLAMAMESH_REDIS_URL": url,
        "LLAMAMESH_REDIS_PREFIX": f"bench:{uuid.uuid4().hex[:6]}",
        "LLAMAMESH_GATEWAY_PORT": str(port),
        "LLAMAMESH_WORKER_ENGINE": "fake",
        "LLAMAMESH_WORKER_FAKE_STEP_S": str(step_s),
        "LLAMAMESH_WORKER_MAX_INFLIGHT": "256",
        "LLAMAMESH_GATEWAY_MAX_TOKENS_CAP": "100000",
        "LLAMAMESH_LOG_LEVEL": "warning",
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with (workdir / "gateway.log").open("ab") as out:
            procs["gateway"] = subprocess.Popen([sys.executable, "-m", "services"], env=env, stdout=out, stderr=out)
        for i in range(workers):
            with (workdir / f"worker-{i}.log").open("ab") as out:
                procs[f"worker-{i}"] = subprocess.Popen(
                    [sys.executable, "-m", "workers"],
                    env={**env, "LLAMAMESH_WORKER_CONSUMER": f"bench-w{i}"},
                    stdout=out,
                    stderr=out,
                )
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not serving(address, "llamamesh.backend.cpu"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"the fleet did not start: see {workdir}")
            time.sleep(0.2)
        yield address, {name: p.pid for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)


async def closed_loop(address: str, concurrency: int, tokens: int, seconds: float, warmup_s: float) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        t_start = time.monotonic()
        t_measure, t_end = t_start + warmup_s, t_start + warmup_s + seconds
        counted = {"tokens": 0, "requests": 0, "errors": 0}

        async def one_client() -> None:
            while time.monotonic() < t_end:
                try:
                    request = pb.GenerateRequest(prompt="bench", max_tokens=tokens, ignore_eos=True)
                    async for m in stub.Generate(request):
                        now = time.monotonic()
                        if t_measure <= now < t_end:
                            counted["tokens"] += len(m.token_ids)
                    if t_measure <= time.monotonic() < t_end:
                        counted["requests"] += 1
                except grpc.aio.AioRpcError:
                    counted["errors"] += 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return {
        "tokens_per_s": counted["tokens"] / seconds,
        "requests_per_s": counted["requests"] / seconds,
        "errors": counted["errors"],
    }


def one(kind: str, workers: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with (
            redis_side(kind, workdir / "redis") as (url, redis_pids),
            fleet(url, workers, args.step_s, workdir) as (
                address,
                pids,
            ),
        ):
            everything = {**pids, **{f"redis-{i}": p for i, p in enumerate(redis_pids)}}
            before = {n: cpu_s(p) for n, p in everything.items()}
            warm_t0 = time.monotonic()
            result = asyncio.run(closed_loop(address, args.concurrency, args.tokens, args.seconds, args.warmup_s))
            assert time.monotonic() - warm_t0 >= args.seconds
            used = {n: cpu_s(p) - before[n] for n, p in everything.items()}
    total_tokens = result["tokens_per_s"] * (args.seconds + args.warmup_s)
    per_k = lambda s: round(1000 * s / max(1.0, total_tokens), 3)  # noqa: E731
    return {
        "redis": kind,
        "workers": workers,
        **{k: round(v, 1) for k, v in result.items()},
        "cpu_s_per_1k_tokens": {
            "gateway": per_k(used["gateway"]),
            "workers": per_k(sum(v for n, v in used.items() if n.startswith("worker"))),
            "redis": per_k(sum(v for n, v in used.items() if n.startswith("redis"))),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--redis", nargs="+", default=["redis", "cluster"], choices=["redis", "cluster"])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--step-s", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    print(
        f"{os.cpu_count()} cores; {args.concurrency} streams of {args.tokens} tokens; "
        f"fake engine, {args.step_s} s a step"
    )
    print(f"{'redis':8} {'workers':>7} {'tok/s':>9} {'req/s':>7} {'err':>4}  cpu s / 1k tokens: gateway workers redis")
    for workers in args.workers:
        for kind in args.redis:  # side by side at each size
            r = one(kind, workers, args)
            rows.append(r)
            c = r["cpu_s_per_1k_tokens"]
            print(
                f"{kind:8} {workers:7d} {r['tokens_per_s']:9.0f} {r['requests_per_s']:7.1f} {r['errors']:4.0f}"
                f"  {c['gateway']:.3f} {c['workers']:.3f} {c['redis']:.3f}",
                flush=True,
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
