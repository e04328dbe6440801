"""Load generator for a llamamesh gateway: N concurrent streaming Generate calls over grpc.aio.

Random prompts of about ``--input-len`` tokens (random token ids of the model's tokenizer, decoded
to text as `vllm bench serve --dataset-name random` does; the real count comes back in usage),
``--output-len`` tokens each with ignore_eos, a fixed number of requests after warm-ups, closed
loop at ``--concurrency``. The load can be spread over ``--processes`` client processes so the
client is never the bottleneck. Reports output tok/s, total tok/s, TTFT, ITL and TPOT percentiles
(ITL = the gap between successive streamed messages that carry tokens, as vllm bench measures
between SSE chunks).

  python bench/load.py --address 127.0.0.1:50051 --tokenizer MODEL_DIR --concurrency 64 \
      --num-requests 512 --warmups 32 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

import grpc

from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc


def make_prompts(tokenizer_dir: str, n: int, input_len: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    return [tok.decode([rng.choice(vocab) for _ in range(input_len)]) for _ in range(n)]


async def _one(stub: Any, prompt: str, output_len: int, sem: asyncio.Semaphore, rec: list[dict]) -> None:
    async with sem:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=output_len, ignore_eos=True, temperature=1.0)
        t0 = time.perf_counter()
        first = last = 0.0
        itl: list[float] = []
        ntok = 0
        usage = None
        async for m in stub.Generate(req):
            if m.token_ids:
                now = time.perf_counter()
                if not first:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                ntok += len(m.token_ids)
            if m.HasField("usage"):
                usage = (m.usage.prompt_tokens, m.usage.completion_tokens)
        rec.append({"start": t0, "ttft": first - t0, "itl": itl, "ntok": ntok, "e2e": last - t0, "end": last,
                    "prompt_tokens": usage[0] if usage else 0})


async def _run(address: str, prompts: list[str], concurrency: int, output_len: int, warm: list[str]) -> dict:
    # One channel per 32 streams: HTTP/2 flow control and one TCP connection per channel.
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, concurrency // 32))]
    stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in channels]
    try:
        if warm:
            wrec: list[dict] = []
            wsem = asyncio.Semaphore(min(concurrency, len(warm)))
            await asyncio.gather(*(_one(stubs[i % len(stubs)], p, output_len, wsem, wrec) for i, p in enumerate(warm)))
        rec: list[dict] = []
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(stubs[i % len(stubs)], p, output_len, sem, rec) for i, p in enumerate(prompts)))
        return {"t0": t0, "rec": rec}
    finally:
        for c in channels:
            await c.close()


def _worker(args: tuple) -> dict:
    address, prompts, concurrency, output_len, warm, barrier_t = args
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    while time.time() < barrier_t:  # all client processes start together
        time.sleep(0.001)
    return asyncio.run(_run(address, prompts, concurrency, output_len, warm))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarise(rec: list[dict], duration: float, label: str, concurrency: int) -> dict:
    ttft = [r["ttft"] * 1e3 for r in rec]
    itl = [x * 1e3 for r in rec for x in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["ntok"] - 1) * 1e3 for r in rec if r["ntok"] > 1]
    n_out = sum(r["ntok"] for r in rec)
    n_in = sum(r["prompt_tokens"] for r in rec)
    return {
        "label": label, "concurrency": concurrency, "num_requests": len(rec), "duration_s": duration,
        "output_tokens": n_out, "prompt_tokens_mean": n_in / max(len(rec), 1),
        "output_tok_per_s": n_out / duration, "total_tok_per_s": (n_out + n_in) / duration,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
        "tpot_ms_p50": pct(tpot, 50), "tpot_ms_mean": statistics.fmean(tpot) if tpot else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--tokenizer", required=True, help="folder with the model's tokenizer")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=0, help="default: 8 x concurrency")
    ap.add_argument("--warmups", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--processes", type=int, default=1, help="client processes sharing the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="llamamesh")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    a = ap.parse_args()
    n = a.num_requests or 8 * a.concurrency
    prompts = make_prompts(a.tokenizer, n + a.warmups, a.input_len, a.seed)
    warm, main_prompts = prompts[: a.warmups], prompts[a.warmups :]
    p = max(1, a.processes)
    parts = [main_prompts[i::p] for i in range(p)]
    wparts = [warm[i::p] for i in range(p)]
    concs = [a.concurrency // p + (1 if i < a.concurrency % p else 0) for i in range(p)]
    start_at = time.time() + 2.0
    if p == 1:
        outs = [_worker((a.address, parts[0], concs[0], a.output_len, wparts[0], 0.0))]
    else:
        with mp.get_context("spawn").Pool(p) as pool:
            outs = pool.map(_worker, [(a.address, parts[i], concs[i], a.output_len, wparts[i], start_at)
                                      for i in range(p)])
    rec = [r for o in outs for r in o["rec"]]
    t0 = min(r["start"] for r in rec) if p == 1 else min(o["t0"] for o in outs)
    duration = max(r["end"] for r in rec) - t0
    res = summarise(rec, duration, a.label, a.concurrency)
    print("[load] RESULT " + json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
