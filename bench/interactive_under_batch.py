"""Interactive latency while a batch runs, for llamamesh or for an OpenAI-compatible
server (``vllm serve``), with the same load on both.

Three phases, in this order, after warm-ups:
  alone   interactive only: --concurrency closed-loop streaming requests, --num-requests of them;
  batch   the batch only: --batch-items requests of the same shape;
  mixed   the batch, and --lead-s after its submission the same interactive load, kept up until the
          batch ends (only interactive requests that ended before it count).
Every request is --input-len random tokens in (as `vllm bench serve --dataset-name random`), --output-len
out with ignore_eos, temperature 1.

llamamesh (--target llamamesh): interactive = streaming Generate; the batch = one BatchGenerate (its
items run at most LLAMAMESH_BATCH_MAX_SHARE of each worker's slots, after interactive requests).
OpenAI (--target openai): interactive = streaming /v1/completions at --priority (vLLM: lower runs
first); the batch = --batch-items non-streaming /v1/completions at --batch-priority, --batch-concurrency
at a time, as a batch producer with its own client would send them.

Reported (one JSON line per phase, then a summary): interactive TTFT p50/p99 and ITL p50/p99, batch
output tokens/s (its completion tokens / submission -> last result), and the targets' ratios: mixed
interactive TTFT p99 / alone (<= 1.5), mixed batch tokens/s / batch alone (>= 0.8).

  python3 bench/interactive_under_batch.py --target llamamesh --address 127.0.0.1:50051 --tokenizer M
  python3 bench/interactive_under_batch.py --target openai --url http://127.0.0.1:8000 --model M --tokenizer M
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.load import _one, _one_openai, completion_body, make_prompts, pct

One = Callable[[int, list[dict]], Awaitable[None]]


async def closed_loop(one: One, concurrency: int, n: int | None, stop: asyncio.Event | None) -> list[dict]:
    """``concurrency`` clients, each sending its next request when its last one ended: ``n`` requests in
    all, or until ``stop`` is set."""
    rec: list[dict] = []
    counter = itertools.count()

    async def client() -> None:
        while True:
            i = next(counter)
            if (n is not None and i >= n) or (stop is not None and stop.is_set()):
                return
            await one(i, rec)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return rec


def interactive_summary(rec: list[dict], until: float | None = None) -> dict:
    if until is not None:
        rec = [r for r in rec if r["end"] <= until]
    ttft = [r["ttft"] * 1e3 for r in rec]
    itl = [x * 1e3 for r in rec for x in r["itl"]]
    return {
        "requests": len(rec),
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "output_tokens": sum(r["ntok"] for r in rec),
    }


class Llamamesh:
    def __init__(self, a: argparse.Namespace) -> None:
        import grpc

        from llamamesh.client import Client
        from llamamesh.v1 import generation_pb2_grpc

        self.a = a
        self.client = Client(a.address)
        # One connection per 32 streams (as bench/load.py): one gateway process serves each connection.
        n = max(1, max(a.concurrency, a.burst_concurrency) // 32) if a.spread else 1
        self.channels = [
            grpc.aio.insecure_channel(a.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(n)
        ]
        self.stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in self.channels]
        self._sem = asyncio.Semaphore(1 << 30)

    async def start(self) -> None:
        await self.client.__aenter__()
        await self.client.wait_ready(300)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()
        await self.client.__aexit__(None, None, None)

    def interactive(self, prompts: list[str]) -> One:
        async def one(i: int, rec: list[dict]) -> None:
            stub = self.stubs[i % len(self.stubs)]
            await _one(stub, prompts[i % len(prompts)], self.a.output_len, self._sem, rec)

        return one

    async def batch(self, prompts: list[str], done: asyncio.Event) -> dict:
        from bench.batch_gpu import run_batch

        return await run_batch(self.client, f"mixed-{time.time_ns()}", prompts, self.a.output_len, done)


class OpenAI:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.session: Any = None

    async def start(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=6 * 3600)
        )

    async def close(self) -> None:
        await self.session.close()

    def interactive(self, prompts: list[str]) -> One:
        url = self.a.url.rstrip("/") + "/v1/completions"
        sem = asyncio.Semaphore(1 << 30)

        async def one(i: int, rec: list[dict]) -> None:
            body = completion_body(self.a.model, prompts[i % len(prompts)], self.a.output_len, self.a.priority)
            await _one_openai(self.session, url, body, sem, rec)

        return one

    async def batch(self, prompts: list[str], done: asyncio.Event) -> dict:
        url = self.a.url.rstrip("/") + "/v1/completions"
        sem = asyncio.Semaphore(self.a.batch_concurrency)
        tokens: list[int] = []

        async def item(p: str) -> None:
            body = completion_body(self.a.model, p, self.a.output_len, self.a.batch_priority, stream=False)
            async with sem, self.session.post(url, json=body) as resp:
                resp.raise_for_status()
                tokens.append((await resp.json())["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        results = await asyncio.gather(*(item(p) for p in prompts), return_exceptions=True)
        elapsed = time.perf_counter() - t0
        done.set()
        failed = [r for r in results if isinstance(r, BaseException)]
        return {
            "state": "COMPLETED" if not failed else f"{len(failed)} FAILED: {failed[0]!r}"[:300],
            "succeeded": len(tokens),
            "total": len(prompts),
            "elapsed_s": elapsed,
            "output_tokens": sum(tokens),
            "output_tok_per_s": sum(tokens) / elapsed,
        }


def burst_sizes(starts: list[float], window_s: float) -> list[int]:
    """Sizes of the groups of request starts no more than ``window_s`` apart from the group's first."""
    sizes: list[int] = []
    first = float("-inf")
    for t in sorted(starts):
        if t - first > window_s:
            sizes.append(0)
            first = t
        sizes[-1] += 1
    return sizes


async def bursts(side: Llamamesh | OpenAI, a: argparse.Namespace, base: dict, prompts: list[str]) -> dict:
    """A closed loop at --burst-concurrency (no batch): how clustered are the
    request starts (a start follows the end of the client's previous request, so clustered starts are
    completions the path delivered together, and they reach the engine as one burst)?"""
    n = 8 * a.burst_concurrency
    t0 = time.perf_counter()
    rec = await closed_loop(side.interactive(prompts), a.burst_concurrency, n, None)
    starts = [r["start"] - t0 for r in rec]
    sizes = burst_sizes(starts, a.burst_window_s)
    return {
        **base,
        "phase": "closed",
        "concurrency": a.burst_concurrency,
        **interactive_summary(rec),
        "output_tok_per_s": sum(r["ntok"] for r in rec) / (max(r["end"] for r in rec) - t0),
        "burst_window_ms": a.burst_window_s * 1e3,
        "bursts": len(sizes),
        "burst_size_mean": sum(sizes) / len(sizes),
        "burst_size_p50": pct(sizes, 50),
        "burst_size_p99": pct(sizes, 99),
        "burst_size_max": max(sizes),
        "starts_s": [round(x, 4) for x in sorted(starts)],
    }


async def _when(event: asyncio.Event) -> float:
    await event.wait()
    return time.perf_counter()


async def main_async(a: argparse.Namespace) -> list[dict]:
    n_inter = a.num_requests or 8 * a.concurrency
    # Every phase gets prompts of its own: none is a prefix-cache hit.
    sizes = {
        "warm": a.warmups,
        "alone": n_inter,
        "batch": a.batch_items,
        "batch_mixed": a.batch_items,
        "mixed": 4 * n_inter,
        "closed": 8 * a.burst_concurrency,
    }
    prompts = make_prompts(a.tokenizer, sum(sizes.values()), a.input_len, a.seed)
    cut = dict(zip(sizes, itertools.accumulate(sizes.values(), initial=0), strict=False))
    part = {k: prompts[cut[k] : cut[k] + n] for k, n in sizes.items()}
    warm, inter, batch_alone, batch_mixed = part["warm"], part["alone"], part["batch"], part["batch_mixed"]
    side: Llamamesh | OpenAI = Llamamesh(a) if a.target == "llamamesh" else OpenAI(a)
    await side.start()
    out: list[dict] = []
    base = {
        "label": a.label,
        "target": a.target,
        "concurrency": a.concurrency,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "batch_items": a.batch_items,
    }
    try:
        if warm:
            await closed_loop(side.interactive(warm), min(a.concurrency, len(warm)), len(warm), None)
        t0 = time.perf_counter()
        rec = await closed_loop(side.interactive(inter), a.concurrency, n_inter, None)
        alone = {**base, "phase": "alone", **interactive_summary(rec), "duration_s": time.perf_counter() - t0}
        out.append(alone)
        print("[mixed] " + json.dumps(alone), flush=True)

        batch = {**base, "phase": "batch", **await side.batch(batch_alone, asyncio.Event())}
        out.append(batch)
        print("[mixed] " + json.dumps(batch), flush=True)

        done = asyncio.Event()
        job = asyncio.create_task(side.batch(batch_mixed, done))
        ended = asyncio.create_task(_when(done))
        await asyncio.wait([job], timeout=a.lead_s)  # the batch at its steady state before the interactive load
        t1 = time.perf_counter()
        rec = await closed_loop(side.interactive(part["mixed"]), a.concurrency, None, done) if not job.done() else []
        res = await job
        # Only the interactive requests that ended before the batch did (the last ones overlap its end).
        inside = interactive_summary(rec, until=await ended)
        mixed = {
            **base,
            "phase": "mixed",
            **inside,
            "interactive_window_s": await ended - t1,
            "batch": res,
            "interactive_requests_after_batch_end": len(rec) - inside["requests"],
        }
        out.append(mixed)
        print("[mixed] " + json.dumps(mixed), flush=True)
        if a.burst_concurrency:
            out.append(await bursts(side, a, base, part["closed"]))
            print("[mixed] " + json.dumps({k: v for k, v in out[-1].items() if k != "starts_s"}), flush=True)
    finally:
        await side.close()
    summary = {
        **base,
        "phase": "summary",
        "ttft_p99_mixed_over_alone": out[2]["ttft_ms_p99"] / out[0]["ttft_ms_p99"],
        "ttft_p50_mixed_over_alone": out[2]["ttft_ms_p50"] / out[0]["ttft_ms_p50"],
        "itl_p99_mixed_over_alone": out[2]["itl_ms_p99"] / out[0]["itl_ms_p99"],
        "batch_mixed_over_alone": out[2]["batch"]["output_tok_per_s"] / out[1]["output_tok_per_s"],
    }
    out.append(summary)
    print("[mixed] " + json.dumps(summary), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("llamamesh", "openai"), required=True)
    ap.add_argument("--address", default="127.0.0.1:50051", help="llamamesh gateway")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI-compatible server")
    ap.add_argument("--model", default="", help="the model name the OpenAI server serves")
    ap.add_argument("--tokenizer", required=True, help="folder with the model's tokenizer")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=0, help="interactive requests alone; default 8 x concurrency")
    ap.add_argument("--warmups", type=int, default=32)
    ap.add_argument("--batch-items", type=int, default=2000)
    ap.add_argument("--batch-concurrency", type=int, default=512, help="openai: batch requests in flight")
    ap.add_argument("--priority", type=int, default=0, help="openai: interactive requests' priority")
    ap.add_argument("--batch-priority", type=int, default=1, help="openai: batch requests' priority")
    ap.add_argument("--lead-s", type=float, default=5.0, help="the batch runs this long before the interactive load")
    ap.add_argument(
        "--burst-concurrency",
        type=int,
        default=0,
        help="then a closed loop at this concurrency (no batch): how clustered are request starts",
    )
    ap.add_argument("--burst-window-s", type=float, default=0.005)
    ap.add_argument(
        "--spread",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llamamesh: one channel per 32 streams (--no-spread: one channel for all)",
    )
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", help="append each phase as one JSON line to this file")
    a = ap.parse_args()
    if a.target == "openai" and not a.model:
        ap.error("--model is needed with --target openai")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out = asyncio.run(main_async(a))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        with open(a.json, "a") as f:
            f.writelines(json.dumps(o) + "\n" for o in out)


if __name__ == "__main__":
    main()
