"""Does batch work yield to interactive requests? Adaptive against static batch admission, side by
side in one invocation, on a small CPU machine with the fake engine at GPU-like step costs.

Each run starts a fresh node (bench/soak.py's: redis-server, the gateway, one worker with
``--slots`` slots on the fake engine, whose step lasts ``--step-s`` plus ``--request-s`` for each
running request and ``--token-s`` for each prompt token starting in it: a GPU's step grows with its
batch and above all with the prefill it carries) and runs bench/interactive_under_batch.py on it:
interactive requests alone, the batch alone, then the batch with the interactive load from
``--lead-s`` after its submission until it ends. Sides run in rotation (A B A B ...), so drift hits
both alike. A side is ``adaptive`` or ``static`` (``LLAMAMESH_BATCH_ADMISSION``), then
``+NAME=VALUE`` settings of its own.

Reported per run and as medians per side: interactive TTFT p50/p99 alone and under the batch, their
ratio, the batch's output tokens/s alone and under the interactive load, and the batch's rate under
the load against the first side's (the targets: TTFT p99 under the batch <= 1.2 x alone; batch
>= 0.9 x the static share's).

  python bench/batch_yield.py --pairs 3 --json bench/results/batch_yield.json   # docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from metrics_cost import start, tokenizer_dir  # bench/ is on the path of `python bench/batch_yield.py`
from soak import Node

HERE = Path(__file__).resolve().parent
KEYS = (
    "ttft_p50_alone",
    "ttft_p99_alone",
    "ttft_p50_mixed",
    "ttft_p99_mixed",
    "p99_ratio",
    "batch_alone",
    "batch_mixed",
)


def one_run(args: argparse.Namespace, tokenizer: str, side: str, workdir: Path) -> dict:
    admission, *extra = side.split("+")
    workdir.mkdir(parents=True)
    env = {
        "LLAMAMESH_WORKER_MAX_INFLIGHT": str(args.slots),
        "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.step_s),
        "LLAMAMESH_WORKER_FAKE_STEP_REQUEST_S": str(args.request_s),
        "LLAMAMESH_WORKER_FAKE_STEP_PROMPT_TOKEN_S": str(args.token_s),
        "LLAMAMESH_BATCH_ADMISSION": admission,
        "LLAMAMESH_BATCH_MAX_SHARE": str(args.max_share),
    }
    env.update(x.split("=", 1) for x in extra)
    node = Node(workdir, env)
    start(node, False)
    try:
        out = workdir / "mixed.json"
        cmd = [sys.executable, "-m", "bench.interactive_under_batch", "--target", "llamamesh"]
        cmd += ["--address", node.address, "--tokenizer", tokenizer, "--label", side, "--json", str(out)]
        cmd += ["--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests)]
        cmd += ["--batch-items", str(args.batch_items), "--warmups", str(args.concurrency)]
        cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--lead-s", str(args.lead_s)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s, cwd=HERE.parent)
        alone, batch, mixed, summary = (json.loads(x) for x in out.read_text().splitlines()[:4])
    finally:
        node.stop()
    row = {
        "side": side,
        "ttft_p50_alone": round(alone["ttft_ms_p50"], 1),
        "ttft_p99_alone": round(alone["ttft_ms_p99"], 1),
        "ttft_p50_mixed": round(mixed["ttft_ms_p50"], 1),
        "ttft_p99_mixed": round(mixed["ttft_ms_p99"], 1),
        "p99_ratio": round(summary["ttft_p99_mixed_over_alone"], 3),
        "batch_alone": round(batch["output_tok_per_s"], 1),
        "batch_mixed": round(mixed["batch"]["output_tok_per_s"], 1),
        "interactive_during_batch": mixed["requests"],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", nargs="+", default=["static", "adaptive"], help="ADMISSION[+NAME=VALUE...]")
    ap.add_argument("--pairs", type=int, default=3, help="rounds of every side")
    ap.add_argument("--slots", type=int, default=64, help="the worker's max_inflight")
    ap.add_argument("--max-share", type=float, default=0.5, help="LLAMAMESH_BATCH_MAX_SHARE: the static share")
    ap.add_argument("--step-s", type=float, default=0.012, help="the fake engine's fixed part of a step")
    ap.add_argument("--request-s", type=float, default=0.00005, help="a step's cost per running request")
    ap.add_argument("--token-s", type=float, default=0.0002, help="a step's cost per prompt token starting in it")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--batch-items", type=int, default=600)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--lead-s", type=float, default=2.0)
    ap.add_argument("--tokenizer", default="", help="a folder with SmolLM2's tokenizer (default: converted)")
    ap.add_argument("--run-timeout-s", type=float, default=600)
    ap.add_argument("--json", default="", help="write the runs and the medians here")
    ap.add_argument("--keep", default="", help="keep each run's node folder (its processes' logs) under here")
    args = ap.parse_args()
    tokenizer = args.tokenizer or tokenizer_dir()
    rows = []
    with tempfile.TemporaryDirectory(prefix="batch-yield-") as tmp:
        for n in range(args.pairs):
            for side in args.sides:
                name = f"{n}-{side.replace('/', '_')}"
                rows.append(one_run(args, tokenizer, side, Path(args.keep or tmp) / name))
    print(
        f"\n{args.concurrency} interactive streams and a {args.batch_items}-item batch, {args.input_len} in / "
        f"{args.output_len} out, {args.slots} slots, max_share {args.max_share}; fake step {args.step_s * 1e3:g} ms "
        f"+ {args.request_s * 1e3:g} ms a request + {args.token_s * 1e3:g} ms a prompt token; {args.pairs} round(s), "
        "medians (ms, tokens/s)"
    )
    width = max(12, *(len(s) + 2 for s in args.sides))
    print(f"{'side':{width}}" + "".join(f"{k:>16}" for k in KEYS) + "   batch vs first side")
    first = None
    medians = {}
    for side in args.sides:
        rs = [r for r in rows if r["side"] == side]
        med = medians[side] = {k: statistics.median(r[k] for r in rs) for k in KEYS}
        first = first or med
        ratio = med["batch_mixed"] / first["batch_mixed"]
        print(f"{side:{width}}" + "".join(f"{med[k]:>16.2f}" for k in KEYS) + f"   {ratio:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
