"""The relay on a small CPU machine at GPU-like token rates: gateway, Redis, one worker on the fake
engine and the load client all on this machine, in rotating runs (A B C A B C ...) in one
invocation, so drift hits every side alike.

Each run starts a fresh node (bench/soak.py's: redis-server, the gateway, one worker process with
``LLAMAMESH_WORKER_FAKE_STEP_S`` = ``--step-s``: 0.02 is 50 tokens/s per stream, so 256 streams
offer 12.8 k tokens/s; 0 is a zero-cost engine, where the relay alone sets the rate) and runs
``bench/load.py --concurrency 256 --input-len 64 --output-len 128``. A side is
``PARSER:GATEWAYS[:LOOP[:CLOCK]][~http][+NAME=VALUE...][@DIR]``: ``python`` hides the hiredis module
(redis-py then parses the Redis protocol in pure Python), ``hiredis`` uses it; GATEWAYS is
``LLAMAMESH_GATEWAY_PROCESSES``; LOOP is ``LLAMAMESH_GATEWAY_EVENT_LOOP`` (default uvloop); CLOCK is
``LLAMAMESH_WORKER_FAKE_CLOCK`` (default deadline: the engine steps on its own clock, as a GPU's
does; ``sleep``: a clock that sleeps after each step, so its step stretches when the worker's loop
is busy and the offered rate drops below 12.8 k under load). ``~http``: the load goes through the
gateway's OpenAI-compatible HTTP door (streamed ``/v1/completions``, the same requests) instead of
gRPC; the server's own queue and TTFT figures are then NaN. ``+NAME=VALUE`` sets one more setting
for that side's node (e.g. ``+LLAMAMESH_GATEWAY_ACCEPTORS=32``). ``@DIR``: the node's gateway and
worker run from the checkout DIR instead of this one (e.g. the code before a change, unpacked with
``git archive REF | tar -x -C DIR``), against the same client, in the same rotation; then the clock
is set only when the side names it (older code has no such setting). ``--keep DIR`` keeps each run's
folder (the processes' logs, and the client's per-request records for bench/waves.py).
Reported per run (a JSON line) and as medians per side: output tokens/s (and its share of the
offered rate when paced), TTFT p50/p99, ITL p50/p99 at the client, and the gateway's and worker's
CPU cores.

  python bench/cpu_relay.py --step-s 0.02 --pairs 3 --json bench/results/cpu_relay_paced.json   # docs/benchmarks.md
  python bench/cpu_relay.py --step-s 0 --sides python:1:asyncio hiredis:1
  python bench/cpu_relay.py --step-s 0.02 --sides hiredis:1:uvloop:sleep hiredis:1
  python bench/cpu_relay.py --step-s 0.02 --sides hiredis:1@/tmp/before hiredis:1
  python bench/cpu_relay.py --step-s 0.02 --sides hiredis:1 hiredis:1~http   # the HTTP door against gRPC
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from metrics_cost import start, tokenizer_dir  # bench/ is on the path of `python bench/cpu_relay.py`
from soak import Node, free_port

HERE = Path(__file__).resolve().parent
KEYS = (
    "tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "gateway_cores",
    "worker_cores",
    "queue_p50_ms",
    "srv_ttft_p50_ms",
)


def no_hiredis(root: Path) -> str:
    """A folder whose ``hiredis`` fails to import, to put first on PYTHONPATH (redis-py falls back)."""
    shim = root / "no-hiredis" / "hiredis"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text('raise ImportError("hidden by bench/cpu_relay.py")\n')
    return str(shim.parent)


def spy(py_spy: str, pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` for the load's first 40 s (collapsed stacks, for flamegraph tools)."""
    args = [py_spy, "record", "-p", str(pid), "-r", "200", "-f", "raw", "-o", str(out), "-d", "40"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_run(args: argparse.Namespace, tokenizer: str, side: str, workdir: Path) -> dict:
    spec, _, code = side.partition("@")
    spec, *extra = spec.split("+")  # +NAME=VALUE: more settings for this side's node
    spec, _, door = spec.partition("~")
    parts = spec.split(":")
    parser, gateways, event_loop, clock = parts + ["uvloop", "deadline"][len(parts) - 2 :]
    workdir.mkdir(parents=True)
    # Room for every stream: the worker keeps LLAMAMESH_WORKER_TENANT_HEADROOM (1) slot for other
    # tenants, so with max_inflight = concurrency one stream of the client's (one tenant) would wait a
    # whole request for a slot each round.
    env = {
        "LLAMAMESH_WORKER_MAX_INFLIGHT": str(max(2 * args.concurrency, 16)),
        "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.step_s),
        "LLAMAMESH_GATEWAY_PROCESSES": gateways,
        "LLAMAMESH_GATEWAY_EVENT_LOOP": event_loop,
    }
    env.update(x.split("=", 1) for x in extra)
    http_port = free_port() if door == "http" else 0
    if http_port:
        env["LLAMAMESH_GATEWAY_HTTP_PORT"] = str(http_port)
    if not code or len(parts) >= 4:
        env["LLAMAMESH_WORKER_FAKE_CLOCK"] = clock
    if parser == "python":
        env["PYTHONPATH"] = os.pathsep.join([no_hiredis(workdir), os.environ.get("PYTHONPATH", "")])
    node = Node(workdir, env)
    here = os.getcwd()
    os.chdir(code or here)  # `python -m services` (and workers) import from the working directory first
    try:
        start(node, False)
    finally:
        os.chdir(here)
    try:
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
            "--label",
            side,
            "--json",
            str(out),
            "--watch",
            f"gateway={node.procs['gateway'].pid}",
            "--watch",
            f"worker={node.procs['worker'].pid}",
        ]
        if http_port:
            url = f"http://127.0.0.1:{http_port}"  # load.py adds /v1/completions
            cmd += ["--openai-url", url, "--model", "smollm2-135m-instruct"]
        if args.keep:  # each request's start, TTFT and end, for bench/waves.py
            cmd += ["--records", str(workdir / "records.jsonl")]
        names = ("gateway", "worker") if args.py_spy else ()
        spies = [spy(args.py_spy, node.procs[n].pid, workdir / f"{n}.py-spy.txt") for n in names]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.run_timeout_s)
        res = json.loads(out.read_text().splitlines()[-1])
        for p in spies:
            p.wait(timeout=args.run_timeout_s)
    finally:
        node.stop()
    cores = res.get("cpu_cores", {})
    row = {
        "side": side,
        "tok_s": round(res["output_tok_per_s"], 1),
        "ttft_p50_ms": round(res["ttft_ms_p50"], 1),
        "ttft_p99_ms": round(res["ttft_ms_p99"], 1),
        "itl_p50_ms": round(res["itl_ms_p50"], 2),
        "itl_p99_ms": round(res["itl_ms_p99"], 2),
        "gateway_cores": cores.get("gateway", {}).get("total"),
        "worker_cores": cores.get("worker", {}).get("total"),
        # The server's view of TTFT: gateway accept -> worker start (queue), -> first token.
        "queue_p50_ms": round(res["server_queue_ms_p50"], 1),
        "srv_ttft_p50_ms": round(res["server_ttft_ms_p50"], 1),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sides",
        nargs="+",
        default=["python:1:asyncio", "hiredis:1:asyncio", "hiredis:1", "hiredis:2"],
        help="PARSER:GATEWAYS[:LOOP[:CLOCK]][~http][+NAME=VALUE...][@DIR]",
    )
    ap.add_argument("--pairs", type=int, default=2, help="rounds of every side")
    ap.add_argument("--step-s", type=float, default=0.02, help="the fake engine's step (0: no cost)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tokenizer", default="", help="a folder with SmolLM2's tokenizer (default: converted)")
    ap.add_argument("--run-timeout-s", type=float, default=300)
    ap.add_argument("--json", default="", help="write the runs and the medians here")
    ap.add_argument("--keep", default="", help="keep each run's node folder (its processes' logs) under here")
    ap.add_argument(
        "--py-spy",
        default="",
        metavar="PATH",
        help="this py-spy records the gateway and the worker of each run (with --keep)",
    )
    args = ap.parse_args()
    tokenizer = args.tokenizer or tokenizer_dir()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu-relay-") as tmp:
        root = Path(args.keep or tmp)
        for n in range(args.pairs):
            for side in args.sides:
                name = side.replace(":", "-").replace("@", "-at-").replace("/", "_")
                rows.append(one_run(args, tokenizer, side, root / f"{n}-{name}"))
    offered = args.concurrency / args.step_s if args.step_s else 0.0
    print(
        f"\n{args.concurrency} streams, {args.input_len} in / {args.output_len} out, fake engine step "
        f"{args.step_s * 1e3:.0f} ms"
        + (f" (offered {offered:.0f} tok/s)" if offered else " (zero cost)")
        + f", {os.cpu_count()} cores, {args.pairs} round(s), medians"
    )
    width = max(20, *(len(s) + 2 for s in args.sides))
    print(f"{'side':{width}}" + "".join(f"{k:>16}" for k in KEYS) + ("   share of offered" if offered else ""))
    medians = {}
    for side in args.sides:
        rs = [r for r in rows if r["side"] == side]
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in KEYS}
        medians[side] = med
        share = f"   {med['tok_s'] / offered:.3f}" if offered else ""
        print(f"{side:{width}}" + "".join(f"{med[k]:>16.2f}" for k in KEYS) + share)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
