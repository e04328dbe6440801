"""Batch jobs on the CPU engine, in one run on one machine (alternating, A B A B):

  batch       N documents as one BatchGenerate (summarise), submit -> completed
  concurrent  the same N requests as N concurrent Generate calls
  ttft-idle   interactive TTFT (sequential short Generate calls) with nothing else running
  ttft-batch  the same while a large batch runs (the batch's share of the worker: LLAMAMESH_BATCH_*)

Same model, prompt template, max_tokens (EOS suppressed with min_tokens) and greedy decoding on every
path; output tok/s counts completion tokens over wall time.

  .venv/bin/python bench/batch_cpu.py [--docs 16] [--max-tokens 32] [--runs 2] [--probes 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

from llamamesh.cli.node import Node
from llamamesh.client import Client
from llamamesh.settings import Settings
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb

TEMPLATE = "Summarise the following document in a few sentences.\n\n{document}"
DOCS = [
    f"Report {i}: the harbour town of Port {chr(65 + i % 26)} grew around its fish market; in {1900 + i} it built a "
    f"lighthouse, and its ferry now carries {100 + 7 * i} passengers a day across the bay to the islands."
    for i in range(256)
]
PROBE = [("user", "Name one colour.")]
ENDED = (bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_FAILED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_CANCELLED)


def params(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)


async def run_batch(c: Client, name: str, docs: list[str], max_tokens: int) -> tuple[float, bpb.Batch]:
    t0 = time.perf_counter()
    req = bpb.BatchGenerateRequest(
        batch_id=name,
        summarise=bpb.Summarise(
            template=TEMPLATE,
            params=params(max_tokens),
            documents=[bpb.Document(custom_id=f"d{i}", text=d) for i, d in enumerate(docs)],
        ),
    )
    b = await c.batches.BatchGenerate(req)
    while b.state not in ENDED:
        await asyncio.sleep(0.05)  # polling for the end: adds at most 50 ms to the measured time
        b = await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=name))
    return time.perf_counter() - t0, b


async def run_concurrent(c: Client, docs: list[str], max_tokens: int) -> tuple[float, int]:
    async def one(d: str) -> int:
        r = params(max_tokens)
        r.messages.append(pb.ChatMessage(role="user", content=TEMPLATE.replace("{document}", d)))
        return sum([len(m.token_ids) async for m in c.stub.Generate(r)])

    t0 = time.perf_counter()
    n = await asyncio.gather(*(one(d) for d in docs))
    return time.perf_counter() - t0, sum(n)


async def ttft(c: Client, probes: int) -> list[float]:
    out = []
    for _ in range(probes):
        t0 = time.perf_counter()
        async for m in c.generate(messages=PROBE, max_tokens=4, temperature=0.0):
            if m.token_ids:
                out.append((time.perf_counter() - t0) * 1000)
                break
    return out


async def ttft_under_batch(c: Client, name: str, probes: int, max_tokens: int) -> tuple[list[float], int]:
    req = bpb.BatchGenerateRequest(
        batch_id=name,
        summarise=bpb.Summarise(
            template=TEMPLATE,
            params=params(max_tokens),
            documents=[bpb.Document(custom_id=f"d{i}", text=d) for i, d in enumerate(DOCS)],
        ),
    )
    await c.batches.BatchGenerate(req)
    while (await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=name))).counts.processing == len(DOCS):  # noqa: ASYNC110 - another process
        await asyncio.sleep(0.05)  # until the batch is running
    await asyncio.sleep(1.0)  # let it fill its share of the worker
    got = await ttft(c, probes)
    b = await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=name))
    running = b.counts.processing
    await c.batches.CancelBatch(bpb.CancelBatchRequest(batch_id=name))
    while (await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=name))).state not in ENDED:  # noqa: ASYNC110 - another process
        await asyncio.sleep(0.1)  # drain before the next measurement
    return got, running


async def main_async(address: str, a: argparse.Namespace) -> dict:
    docs = DOCS[: a.docs]
    rows: dict[str, list] = {"batch": [], "concurrent": [], "ttft_idle": [], "ttft_batch": []}
    async with Client(address) as c:
        await c.wait_ready(300)
        await c.complete(messages=PROBE, max_tokens=4)  # the worker's model is loaded
        for r in range(a.runs):
            secs, b = await run_batch(c, f"bench-{r}-{time.time_ns()}", docs, a.max_tokens)
            assert b.counts.succeeded == len(docs), b
            rows["batch"].append(len(docs) * a.max_tokens / secs)
            secs, n = await run_concurrent(c, docs, a.max_tokens)
            rows["concurrent"].append(n / secs)
            rows["ttft_idle"] += await ttft(c, a.probes)
            got, _ = await ttft_under_batch(c, f"load-{r}-{time.time_ns()}", a.probes, a.max_tokens)
            rows["ttft_batch"] += got
            print(
                f"run {r + 1}: batch {rows['batch'][-1]:.1f} tok/s, concurrent {rows['concurrent'][-1]:.1f} tok/s, "
                f"TTFT idle {statistics.median(rows['ttft_idle'][-a.probes :]):.0f} ms, under batch "
                f"{statistics.median(got):.0f} ms",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-inflight", type=int, default=8)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    base = Settings.from_env()
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        settings = base.with_overrides(
            redis={"url": ""},
            gateway={"port": port},
            log={"level": "warning"},
            worker={
                "engine": "transformers",
                "threads": a.threads or base.worker.torch_threads(),
                "max_inflight": a.max_inflight,
            },
        )
        node = Node(settings, log_file=Path(tmp) / "node.log")
        node.start()
        try:
            rows = asyncio.run(main_async(node.address, a))
        finally:
            node.stop()
    b = settings.batch
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"\n{a.docs} documents x {a.max_tokens} tokens, greedy, {settings.worker.threads} torch thread(s), "
        f"max_inflight {a.max_inflight}, batch share {b.min_share:g}-{b.max_share:g}, {a.runs} runs alternating"
    )
    print(f"batch       {med['batch']:7.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in rows['batch'])})")
    print(f"concurrent  {med['concurrent']:7.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in rows['concurrent'])})")
    print(f"batch / concurrent = {med['batch'] / med['concurrent']:.2f}")
    print(
        f"interactive TTFT p50: idle {med['ttft_idle']:.0f} ms, under batch load {med['ttft_batch']:.0f} ms "
        f"({med['ttft_batch'] / med['ttft_idle']:.2f} x; target <= 1.20)"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        a.json.write_text(json.dumps({"rows": rows, "median": med}, indent=1))


if __name__ == "__main__":
    main()
