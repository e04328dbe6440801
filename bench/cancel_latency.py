"""Disconnect -> abort: how long after a client drops its stream the worker aborts the generation.

Starts a node (embedded Valkey, one gateway process, one worker process on the fake engine, so the
figure is the serving path's and not a model's step time), then for each of N requests: stream
until the first tokens, cancel the call (what a client disconnect does) and note the wall time.
The worker logs ``job_cancel_requested`` (just before ``engine.abort``) with its wall time; the
latency is the difference (one machine, one clock). Also measured: the Cancel RPC from another
connection, the same way.

  .venv/bin/python bench/cancel_latency.py [--requests 200] [--concurrency 8] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import grpc

from llamamesh.cli.node import Node
from llamamesh.settings import Settings
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc


async def one(stub: pb_grpc.GenerationServiceStub, rid: str, how: str, sent: dict[str, float]) -> None:
    call = stub.Generate(pb.GenerateRequest(request_id=rid, prompt="a long answer", max_tokens=2000))
    seen = 0
    while seen < 2:
        m = await call.read()
        seen += len(m.token_ids)
    sent[rid] = time.time()
    if how == "disconnect":
        call.cancel()
    else:
        await stub.Cancel(pb.CancelRequest(request_id=rid))
        while await call.read() is not grpc.aio.EOF:  # the stream ends with finish_reason CANCELLED
            pass


async def drive(address: str, n: int, concurrency: int, how: str, sent: dict[str, float]) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        await ch.channel_ready()
        sem = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> None:
            async with sem:
                await one(stub, f"{how}-{i}", how, sent)

        await asyncio.gather(*(bounded(i) for i in range(n)))


def aborted_at(log: Path) -> dict[str, float]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"job_cancel_requested"' in line:
            rec = json.loads(line)
            out[rec["request_id"]] = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        settings = Settings.from_env().with_overrides(
            redis={"url": ""},
            gateway={"port": port},
            log={"format": "json"},
            worker={"engine": "fake", "fake_step_s": a.step_ms / 1000, "max_inflight": 64},
        )
        log = Path(tmp) / "node.log"
        node = Node(settings, log_file=log)
        node.start()
        sent: dict[str, float] = {}
        try:
            deadline = time.monotonic() + 60
            while '"worker_started"' not in log.read_text(errors="replace"):
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)  # polling the node's log, bounded
            for how in ("disconnect", "cancel-rpc"):
                asyncio.run(drive(node.address, a.requests, a.concurrency, how, sent))
            deadline = time.monotonic() + 10
            while len(done := aborted_at(log)) < len(sent) and time.monotonic() < deadline:
                time.sleep(0.1)  # the last aborts reach the log (bounded: a missing one is reported)
        finally:
            node.stop()
    res = {}
    for how in ("disconnect", "cancel-rpc"):
        ms = [(done[r] - t) * 1000 for r, t in sent.items() if r.startswith(how) and r in done]
        res[how] = {
            "n": len(ms),
            "missing": sum(1 for r in sent if r.startswith(how) and r not in done),
            "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(pct(ms, 0.99), 1),
            "max_ms": round(max(ms), 1),
        }
        print(
            f"{how:11s} -> abort: p50 {res[how]['p50_ms']} ms, p99 {res[how]['p99_ms']} ms, "
            f"max {res[how]['max_ms']} ms ({res[how]['n']} requests, {res[how]['missing']} never aborted)"
        )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
