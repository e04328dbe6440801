"""A batch through BatchGenerate on a running llamamesh (gateway + vLLM worker), the same workload as
offline ``LLM.generate`` in bench/offline_generate.py: N random prompts of --input-len tokens,
--output-len tokens out (ignore_eos), temperature 1. bench/gpu_compare.sh runs both in one
invocation (stage ``batch`` or ``batchworker`` against stage ``offline``).

Measured: submit -> the batch completed (GetBatch polled every 50 ms, so at most 50 ms late); output
tok/s = the completion tokens of the results / that wall time. A --warmup batch runs first, as the
offline script's warm-up prompts do.

  python3 bench/batch_gpu.py --address 127.0.0.1:50051 --tokenizer MODEL_DIR [--num-prompts 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.load import make_prompts
from llamamesh.client import Client
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb

ENDED = (bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_FAILED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_CANCELLED)


async def run_batch(
    c: Client, name: str, prompts: list[str], output_len: int, done: asyncio.Event | None = None
) -> dict:
    """Submit one batch and wait for its end (``done`` is set then, before its results are read)."""
    req = bpb.BatchGenerateRequest(
        batch_id=name,
        items=[
            bpb.BatchItem(
                custom_id=f"p{i}",
                request=pb.GenerateRequest(prompt=p, max_tokens=output_len, ignore_eos=True, temperature=1.0),
            )
            for i, p in enumerate(prompts)
        ],
    )
    t0 = time.perf_counter()
    b = await c.batches.BatchGenerate(req)
    submitted = time.perf_counter() - t0
    while b.state not in ENDED:
        await asyncio.sleep(0.05)  # another process does the work; bounded by the batch's end
        b = await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=name))
    elapsed = time.perf_counter() - t0
    if done is not None:
        done.set()
    out_tokens = in_tokens = 0
    async for r in c.batches.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id=name, follow=False)):
        out_tokens += r.usage.completion_tokens
        in_tokens += r.usage.prompt_tokens
    return {
        "state": bpb.BatchState.Name(b.state),
        "succeeded": b.counts.succeeded,
        "total": b.counts.total,
        "elapsed_s": elapsed,
        "submit_s": submitted,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_tok_per_s": out_tokens / elapsed,
        "requests_per_s": b.counts.succeeded / elapsed,
    }


async def main_async(a: argparse.Namespace) -> dict:
    prompts = make_prompts(a.tokenizer, a.warmup + a.num_prompts, a.input_len, a.seed)
    async with Client(a.address) as c:
        await c.wait_ready(300)
        if a.warmup:
            await run_batch(c, f"warm-{time.time_ns()}", prompts[: a.warmup], a.output_len)
        res = await run_batch(c, f"bench-{time.time_ns()}", prompts[a.warmup :], a.output_len)
    return {
        "bench": "llamamesh BatchGenerate",
        "label": a.label,
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        **res,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="llamamesh-batch")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = asyncio.run(main_async(a))
    print("[batch] RESULT " + json.dumps(res), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
