"""Prefix affinity and prompt normalisation on one GPU: two engines share a
workload whose prompts share prefixes; does each prefix meet the engine that cached it?

Every run starts a fresh fleet (bench/soak.py's Node: Redis, one gateway process, and two worker
processes here, each with its own metrics and health port), and the runs alternate A B A B in one
invocation, so drift on the machine hits both sides alike. Two workloads:

- ``shared``: ``--docs`` documents of ``--doc-tokens`` tokens (random token text, exactly that many
  tokens with ``--tokenizer`` as bench/load.py's make_prompts makes them; else as many common
  one-token words, about that many tokens), each asked ``--questions`` short questions; prompt =
  document + question, so the document is the shared prefix. The requests are shuffled with a fixed
  seed and sent closed-loop at ``--concurrency`` (bench/load.py's client: streaming Generate,
  ``--max-tokens`` with ignore_eos), after ``--warmups`` short unrelated ones. A: affinity off
  (LLAMAMESH_REDIS_AFFINITY_PARTITIONS=0 on the gateway and the workers); B: on (``--partitions``).
- ``html``: the same prompts with an HTML table of random ids (``<td id="a3f9-...">``, new ids in
  every request, the same cells for a document's every question) before the document
  (``--html-at question``: between the document and the question), so the region a document's
  questions share, and the gateway's prefix key, differ per request unless normalised. Affinity on
  in both runs. A: no normalisation; B: LLAMAMESH_GATEWAY_NORMALIZE_RULES rewriting ``id="..."`` to
  ``id="REDACTED"``.
- ``multiturn``: ``--docs`` conversations at once (bench/multiturn.py), each ``--turns`` chat turns
  whose messages grow by every answer (the first: a document and a question), each turn sent when
  the last one ended, with ``prefix_key`` = the conversation. A: round-robin (affinity off); B:
  affinity by conversation (``--partitions``, ``--placement``: balanced by default here, each new
  conversation on the worker with the fewest; hash by default for the other workloads). Targets:
  tok/s >= 1.3x, TTFT p50 <= 0.5x of A.

``--engine vllm``: both workers on the one GPU (LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION 0.45 each,
prefix caching on, one frontend each), started one after the other: vLLM's memory profile assumes
no other process on the GPU changes its usage meanwhile. ``--engine fake``: the same orchestration
on the fake engine (no cache: the hit rate is n/a), which tests this script's mechanics.

Reported per run (one JSON line) and as medians per side: the prefix-cache hit rate (the delta of
``vllm:prefix_cache_hits_total`` over that of ``vllm:prefix_cache_queries_total``, both counted in
prompt tokens, summed over the two workers' scrapes, over the measured requests only), output tok/s,
TTFT p50/p99 (at the client), ``llamamesh_affinity_leases_total{kind}`` own and stolen, and the jobs
each worker started (with affinity on, beside the split the partition owners alone would give: the
gateway's key of each prompt through the queue's partition function); next to them the targets
(hit rate >= 90 % with affinity, tok/s >= 1.3x and TTFT p50 <= 0.7x of affinity off).
``--budget-s``: start no pair that would end past it (at the pace of the longest run so far), so an
outer time limit cuts between pairs, not inside a run; ``--json`` is rewritten after each run.

  python bench/prefix_affinity.py --engine fake --pairs 1                    # mechanics, any machine
  python bench/prefix_affinity.py --engine vllm --workload shared --pairs 2 --model-path MODEL_DIR \\
      --json bench/results/prefix_affinity_shared.json                       # docs/benchmarks.md
  LLAMAMESH_VLLM_ENFORCE_EAGER=true python bench/prefix_affinity.py --engine vllm --workload multiturn \\
      --pairs 1 --doc-tokens 2500 --max-tokens 64 --answer-spread 0.5 --kv-blocks 7500 --model-path MODEL_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis
from load import _run, make_prompts, summarise  # bench/ is on the path of `python bench/prefix_affinity.py`
from multiturn import openings, run_conversations
from prometheus_client.parser import text_string_to_metric_families
from soak import Node, free_port, wait_for

from llamamesh.queue.affinity import partition_of
from llamamesh.queue.keys import Keys
from llamamesh.settings import Settings
from llamamesh.types import GenerationRequest, affinity_key
from services.normalize import Normalizer

POOL = "prefix"
WORKERS = 2
HTML_IDS_RULE = json.dumps([{"name": "html-ids", "pattern": 'id="[a-z0-9-]+"', "replacement": 'id="REDACTED"'}])
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
LEASES, STARTED = "llamamesh_affinity_leases_total", "llamamesh_jobs_started_total"
# One token each (with its leading space) in SmolLM2's tokenizer, the dummy model's (checked).
_WORDS = (
    "the of and to in is was for on that with as by at from it an be this which are or his her had not but have they "
    "one were all their there been has more when who will would can if its about into than them some only other time "
    "new could these two may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should"
)
WORDS = tuple(_WORDS.split())
QUESTIONS = (
    "What is the main subject of the text above?",
    "Which word appears most often in it?",
    "Summarise the text in one sentence.",
    "What would a good title for it be?",
    "Who is the text written for?",
    "Name three words from its first line.",
    "Is the text a story, a report or a list?",
    "What should a reader do after reading it?",
)
SIDES = {
    "shared": ("affinity off", "affinity on"),
    "html": ("no normalisation", "normalised"),
    "multiturn": ("round-robin", "by conversation"),
}
# (tok/s B/A at least, TTFT p50 B/A at most)
TARGETS = {"shared": (1.30, 0.70), "html": (1.30, 0.70), "multiturn": (1.30, 0.50)}


def documents(args: argparse.Namespace) -> list[str]:
    if args.tokenizer:
        return make_prompts(args.tokenizer, args.docs, args.doc_tokens, args.seed)
    rng = random.Random(args.seed)
    return [" ".join(rng.choice(WORDS) for _ in range(args.doc_tokens)) for _ in range(args.docs)]


def html_table(doc: int, rows: int, ids: random.Random) -> str:
    """A table whose cells are the document's own (the same in each of its requests) and whose ids
    are drawn from ``ids`` (new in every request)."""
    cells = random.Random(f"cells-{doc}")
    lines = ["<table>"]
    for r in range(rows):
        a, b = (f"{ids.getrandbits(16):04x}-{ids.getrandbits(32):08x}" for _ in range(2))
        lines.append(f'<tr><td id="{a}">{cells.choice(WORDS)} {r}</td><td id="{b}">{cells.randint(0, 9999)}</td></tr>')
    return "\n".join([*lines, "</table>"])


def prompts(args: argparse.Namespace, docs: list[str], workload: str) -> list[str]:
    """Every (document, question) once, in one fixed shuffled order (and, for ``html``, with one fixed
    draw of ids), so both sides of every pair send the same requests in the same order. For
    ``multiturn``: each conversation's opening message (a document and its first question)."""
    if workload == "multiturn":
        return openings(docs, QUESTIONS)
    order = [(d, q) for d in range(len(docs)) for q in range(args.questions)]
    random.Random(args.seed).shuffle(order)
    ids = random.Random(args.seed + 1)
    out = []
    for d, q in order:
        question = QUESTIONS[q % len(QUESTIONS)] + (f" (part {q // len(QUESTIONS) + 1})" if q >= len(QUESTIONS) else "")
        head = docs[d]
        if workload == "html":
            table = html_table(d, args.html_rows, ids)
            head = f"{table}\n\n{head}" if args.html_at == "start" else f"{head}\n\n{table}"
        out.append(f"{head}\n\nQuestion: {question}\nAnswer:")
    return out


class Fleet(Node):
    """soak.Node's Redis and gateway, and ``WORKERS`` worker processes, each in a session of its own
    (a vLLM worker's engine core is its child: stopping kills the whole group, so no GPU memory is
    left held) with its own consumer name, metrics port and health port."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        super().__init__(workdir, env)
        self.ports = [(free_port(), free_port()) for _ in range(WORKERS)]  # (metrics, health)
        self.names = [f"pa-w{i}" for i in range(WORKERS)]
        self.owners: dict[int, str] = {}  # partition -> worker, once balanced

    def spawn_worker(self, i: int) -> None:
        metrics_port, health_port = self.ports[i]
        env = {
            **self.env,
            "LLAMAMESH_WORKER_CONSUMER": self.names[i],
            "LLAMAMESH_WORKER_METRICS_PORT": str(metrics_port),
            "LLAMAMESH_WORKER_HEALTH_PORT": str(health_port),
        }
        with (self.dir / f"worker-{i}.log").open("ab") as out:
            self.procs[f"worker-{i}"] = subprocess.Popen(
                [sys.executable, "-m", "workers"], env=env, stdout=out, stderr=out, start_new_session=True
            )

    def ready(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[i][1]}/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def balanced(self, partitions: int) -> bool:
        """Every partition owned, and each worker holding its share (ownership moves at heartbeats)."""
        with contextlib.closing(redis.Redis(port=self.redis_port, decode_responses=True)) as r:
            owners = r.hgetall(Keys(self.prefix).owners(POOL))
        self.owners = {int(k): str(v).split()[0] for k, v in owners.items() if str(k).isdigit()}
        held = collections.Counter(self.owners.values())
        share = partitions // WORKERS
        return set(held) == set(self.names) and sum(held.values()) == partitions and min(held.values()) >= share

    def start_fleet(self, partitions: int, start_timeout_s: float) -> None:
        self.start_redis()
        self.spawn("gateway", "services")
        for i in range(WORKERS):  # one after the other: each engine's memory profile runs alone
            self.spawn_worker(i)
            wait_for(lambda i=i: self.ready(i), start_timeout_s, f"worker {i} to be ready", self.procs)
        if partitions:
            wait_for(lambda: self.balanced(partitions), 30, "the partitions to be shared out", self.procs)
        wait_for(lambda: self.serving(f"llamamesh.backend.{POOL}"), 60, "the pool to be SERVING", self.procs)

    def scrape(self) -> dict[tuple[str, str], float]:
        """(metric, kind label) -> value, summed over both workers' /metrics (jobs started: by port)."""
        out: dict[tuple[str, str], float] = collections.defaultdict(float)
        for metrics_port, _ in self.ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name in (HITS, QUERIES, LEASES):
                        out[(s.name, s.labels.get("kind", ""))] += s.value
                    elif s.name == STARTED:
                        out[(s.name, str(metrics_port))] += s.value
        return out

    def settled(self) -> dict[tuple[str, str], float]:
        """A scrape once the counters stopped moving (vLLM records a step's stats after its output)."""
        last = self.scrape()
        for _ in range(20):
            time.sleep(0.5)  # polling another process's counters, bounded
            now = self.scrape()
            if now == last:
                break
            last = now
        return last

    def predicted(self, prompts: list[str], partitions: int) -> list[int]:
        """Jobs each worker starts if every job meets its partition's owner (no steals): the gateway's
        key of each prompt (a hash of its first GATEWAY_AFFINITY_PREFIX_CHARS characters, hashed again
        after the normalisation rules rewrote the prompt, as services/normalize.py does) through the
        queue's own partition function, against the ownership seen before the load."""
        gw = Settings.from_env(self.env).gateway
        rules = Normalizer.parse(self.env.get("LLAMAMESH_GATEWAY_NORMALIZE_RULES", ""), gw.affinity_prefix_chars)
        per: collections.Counter[str] = collections.Counter()
        for p in prompts:
            key = affinity_key(p, None, gw.affinity_prefix_chars)
            req = rules.apply(GenerationRequest("p", "m", prompt=p, prefix_key=key))
            per[self.owners.get(partition_of(req, partitions), "?")] += 1
        return [per[name] for name in self.names]

    def stop(self) -> None:
        workers = [p for name, p in self.procs.items() if name.startswith("worker-")]
        for p in workers:
            if p.poll() is None:
                p.terminate()
        for p in workers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # its session: what it left behind (vLLM's engine core)
        super().stop()


def gpu_released() -> None:
    """Wait until no process holds the GPU (the next fleet's memory profile needs all of it)."""
    if not shutil.which("nvidia-smi"):
        return
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    wait_for(
        lambda: not subprocess.run(query, capture_output=True, text=True).stdout.strip(), 60, "the GPU to be released"
    )


def placement_of(args: argparse.Namespace, workload: str) -> str:
    """``--placement``, else balanced for conversations and hash for the document workloads."""
    return args.placement or ("balanced" if workload == "multiturn" else "hash")


def fleet_env(args: argparse.Namespace, workload: str, b_side: bool) -> dict[str, str]:
    affinity = b_side or workload == "html"
    model = Path(args.model_path).name if args.engine == "vllm" else "smollm2-135m-instruct"
    env = {
        "LLAMAMESH_WORKER_POOL": POOL,
        "LLAMAMESH_WORKER_MODEL": model,
        "LLAMAMESH_GATEWAY_MODELS": f"{model}={POOL}",
        "LLAMAMESH_WORKER_ENGINE": args.engine,
        "LLAMAMESH_WORKER_MAX_INFLIGHT": str(args.max_inflight),
        "LLAMAMESH_WORKER_GRACE_S": "5",
        "LLAMAMESH_LOG_LEVEL": args.log_level,
        "LLAMAMESH_REDIS_AFFINITY_PARTITIONS": str(args.partitions if affinity else 0),
        "LLAMAMESH_REDIS_AFFINITY_PLACEMENT": placement_of(args, workload),
        "LLAMAMESH_GATEWAY_NORMALIZE_RULES": HTML_IDS_RULE if workload == "html" and b_side else "",
    }
    if args.engine == "fake":
        return env | {
            "LLAMAMESH_WORKER_FAKE_STEP_S": str(args.fake_step_s),
            "LLAMAMESH_WORKER_MAX_MODEL_LEN": str(args.max_model_len),
        }
    env |= {
        "LLAMAMESH_WORKER_MODEL_PATH": args.model_path,
        "LLAMAMESH_VLLM_DTYPE": "bfloat16",
        "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": str(args.gpu_memory_utilization),
        "LLAMAMESH_VLLM_ENABLE_PREFIX_CACHING": "true",
        "LLAMAMESH_VLLM_MAX_MODEL_LEN": str(args.max_model_len),
        "LLAMAMESH_VLLM_MAX_NUM_SEQS": str(args.max_inflight),
        "LLAMAMESH_VLLM_FRONTENDS": "1",
        "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE": "1",
        "LLAMAMESH_VLLM_SEED": "0",
        "LLAMAMESH_VLLM_LOAD_FORMAT": args.load_format,
        "LLAMAMESH_VLLM_EXTRA_ARGS": json.dumps({"num_gpu_blocks_override": args.kv_blocks} if args.kv_blocks else {}),
    }
    return env


def one_run(
    args: argparse.Namespace, pair: int, workload: str, b_side: bool, main: list[str], warm: list[str], workdir: Path
) -> dict:
    t_fleet = time.monotonic()
    fleet = Fleet(workdir, fleet_env(args, workload, b_side))
    affinity = b_side or workload == "html"
    try:
        fleet.start_fleet(args.partitions if affinity else 0, args.start_timeout_s)
        started_s = time.monotonic() - t_fleet
        if warm:
            asyncio.run(_run(fleet.address, warm, args.concurrency, args.max_tokens, []))
        before = fleet.settled()
        if workload == "multiturn":
            out = asyncio.run(
                run_conversations(fleet.address, main, args.turns, args.max_tokens, args.answer_spread, args.seed)
            )
        else:
            out = asyncio.run(_run(fleet.address, main, args.concurrency, args.max_tokens, []))
        after = fleet.settled()
    finally:
        fleet.stop()
        if args.engine == "vllm":
            gpu_released()
    rec = out["rec"]
    concurrency = len(main) if workload == "multiturn" else args.concurrency  # one stream per conversation
    # the owners' split by the prompts' hashes: what hash placement gives (balanced places as it goes)
    predictable = affinity and workload != "multiturn" and placement_of(args, workload) == "hash"
    res = summarise(rec, max(r["end"] for r in rec) - out["t0"], workload, concurrency)
    d = collections.defaultdict(float, {k: v - before.get(k, 0.0) for k, v in after.items()})
    queries = d[(QUERIES, "")]
    row = {
        "pair": pair,
        "workload": workload,
        "side": SIDES[workload][b_side],
        "b": b_side,
        "partitions": args.partitions if affinity else 0,
        "placement": placement_of(args, workload) if affinity else "",
        "normalised": workload == "html" and b_side,
        "requests": res["num_requests"],
        "prompt_tokens_mean": round(res["prompt_tokens_mean"], 1),
        "tok_s": round(res["output_tok_per_s"], 1),
        "ttft_p50_ms": round(res["ttft_ms_p50"], 1),
        "ttft_p99_ms": round(res["ttft_ms_p99"], 1),
        "itl_p50_ms": round(res["itl_ms_p50"], 2),
        "hit_rate": round(d[(HITS, "")] / queries, 4) if queries else None,
        "cache_hits": d[(HITS, "")],
        "cache_queries": queries,
        "leases_own": d[(LEASES, "own")],
        "leases_stolen": d[(LEASES, "stolen")],
        "jobs_per_worker": [d[(STARTED, str(m))] for m, _ in fleet.ports],
        "jobs_predicted": fleet.predicted(main, args.partitions) if predictable else None,
        "load_s": round(res["duration_s"], 2),
        "fleet_start_s": round(started_s, 1),
        "run_s": round(time.monotonic() - t_fleet, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def median(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r[key] is not None]
    return statistics.median(xs) if xs else None


def verdict(ok: bool | None, engine: str) -> str:
    if engine == "fake" or ok is None:
        return "(n/a: fake engine)" if engine == "fake" else "(n/a)"
    return "met" if ok else "NOT met"


def report(rows: list[dict], args: argparse.Namespace) -> dict:
    summary: dict = {}
    for workload in args.workload:
        a = [r for r in rows if r["workload"] == workload and not r["b"]]
        b = [r for r in rows if r["workload"] == workload and r["b"]]
        if not a or not b:
            continue
        side_a, side_b = SIDES[workload]
        shape = (
            f"{args.docs} conversations x {args.turns} turns at once"
            if workload == "multiturn"
            else f"{args.docs} documents x {args.questions} questions, concurrency {args.concurrency}"
        )
        print(
            f"\n{workload}: {shape}, ~{a[0]['prompt_tokens_mean']:.0f} prompt tokens, {args.max_tokens} out"
            f"{f' +-{args.answer_spread:.0%}' if workload == 'multiturn' and args.answer_spread else ''}, "
            f"{args.engine} engine, {min(len(a), len(b))} pair(s), medians"
        )
        print(f"{'':24}{side_a:>18}{side_b:>18}{'B/A':>8}   target")
        med = {k: (median(a, k), median(b, k)) for k in ("hit_rate", "tok_s", "ttft_p50_ms", "ttft_p99_ms")}
        hr = med["hit_rate"]
        fmt = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
        hit_ok = None if hr[1] is None else hr[1] >= 0.90
        hit_target = "" if workload == "multiturn" else f">= 90 % on B: {verdict(hit_ok, args.engine)}"
        print(f"{'prefix-cache hit rate':24}{fmt(hr[0]):>18}{fmt(hr[1]):>18}{'':8}   {hit_target}")
        tok_min, ttft_max = TARGETS[workload]
        for key, label, want in (
            ("tok_s", "output tok/s", f">= {tok_min:.2f}x"),
            ("ttft_p50_ms", "TTFT p50 ms", f"<= {ttft_max:.2f}x"),
            ("ttft_p99_ms", "TTFT p99 ms", ""),
        ):
            x, y = med[key]
            ratio = y / x if x and y is not None else float("nan")
            ok = ratio >= tok_min if key == "tok_s" else ratio <= ttft_max
            tail = f"{want}: {verdict(ok, args.engine)}" if want else ""
            print(f"{label:24}{x:>18.1f}{y:>18.1f}{ratio:>8.3f}   {tail}")
        leases = [f"{median(rs, 'leases_own'):.0f} / {median(rs, 'leases_stolen'):.0f}" for rs in (a, b)]
        print(f"{'leases own / stolen':24}{leases[0]:>18}{leases[1]:>18}")

        def split(r: dict) -> str:
            owners = f" (owners: {'/'.join(map(str, r['jobs_predicted']))})" if r["jobs_predicted"] else ""
            return "/".join(f"{j:.0f}" for j in r["jobs_per_worker"]) + owners

        print(f"jobs per worker, A runs then B runs: {' | '.join(split(r) for r in a + b)}")
        pairs = [y["tok_s"] / x["tok_s"] for x, y in zip(a, b, strict=False)]  # a budget may cut the last pair
        print("tok/s B/A per pair:", " ".join(f"{p:.3f}" for p in pairs))
        if workload == "multiturn":
            print("turn 1 of a conversation finds nothing cached; every later turn can find all but its last answer")
        else:
            print(
                f"hit-rate ceiling: about {(args.questions - 1) / args.questions:.1%} of the tokens a document's "
                f"questions share (its first request finds nothing cached; {args.questions} questions each)"
            )
        summary[workload] = {"a": side_a, "b": side_b, "medians": med, "tok_s_ratio_per_pair": pairs}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["vllm", "fake"], default="vllm")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--workload", nargs="+", choices=list(SIDES), default=["shared", "html"])
    ap.add_argument("--model-path", default="/tmp/vllmdev/model/llama8b-dummy")
    ap.add_argument("--load-format", default="dummy", help="vLLM's load_format ('' : the model's weights)")
    ap.add_argument("--tokenizer", default="", help="documents of exactly --doc-tokens tokens of this tokenizer")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8, help="multiturn: turns per conversation (--docs conversations)")
    ap.add_argument(
        "--answer-spread",
        type=float,
        default=0.0,
        help="multiturn: each answer's length drawn from --max-tokens * [1 - s, 1 + s] (0: all --max-tokens)",
    )
    ap.add_argument("--html-rows", type=int, default=16, help="rows of two id-carrying cells each")
    ap.add_argument(
        "--html-at",
        choices=["question", "start"],
        default="start",
        help="the table before the document (the default), or between document and question",
    )
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmups", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partitions", type=int, default=16, help="LLAMAMESH_REDIS_AFFINITY_PARTITIONS with affinity on")
    ap.add_argument(
        "--placement",
        choices=["hash", "balanced"],
        default="",
        help="LLAMAMESH_REDIS_AFFINITY_PLACEMENT with affinity on (default: balanced for multiturn, else hash)",
    )
    ap.add_argument("--max-inflight", type=int, default=128, help="per worker (and vLLM's max_num_seqs)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--kv-blocks", type=int, default=0, help="cap each engine's KV cache (num_gpu_blocks_override)")
    ap.add_argument("--fake-step-s", type=float, default=0.005)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--budget-s", type=float, default=0, help="start no run that would end past this (0: none)")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--logs", default="", help="keep every run's logs under this folder")
    ap.add_argument("--json", default="", help="write the runs and the medians here (rewritten after each run)")
    args = ap.parse_args()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
    if args.engine == "vllm" and not args.tokenizer:
        args.tokenizer = args.model_path
    t0 = time.monotonic()
    docs = documents(args)
    work = {w: prompts(args, docs, w) for w in args.workload}
    rng = random.Random(args.seed + 2)
    warm = [f"Warm-up {i}: " + " ".join(rng.choice(WORDS) for _ in range(64)) for i in range(args.warmups)]
    print(
        f"{len(docs)} documents made in {time.monotonic() - t0:.1f} s; {os.cpu_count()} cores; engine {args.engine}",
        flush=True,
    )
    plan = [(pair, w, b) for pair in range(args.pairs) for w in args.workload for b in (False, True)]
    rows: list[dict] = []
    failed = ""
    root = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="prefix-affinity-"))
    longest = 0.0
    for n, (pair, workload, b_side) in enumerate(plan):
        # An A run starts only with time for its B run too, so the medians are of whole pairs.
        if args.budget_s and time.monotonic() - t0 + longest * (1 if b_side else 2) > args.budget_s:
            print(f"budget: {args.budget_s:.0f} s would be passed; {len(plan) - n} run(s) not started", flush=True)
            break
        workdir = root / f"{n:02d}-{workload}-{'b' if b_side else 'a'}"
        workdir.mkdir(parents=True)
        t_run = time.monotonic()
        try:
            rows.append(one_run(args, pair, workload, b_side, work[workload], warm, workdir))
        except Exception as exc:  # a run that fails ends the benchmark, with what its processes said
            failed = f"{workload} {SIDES[workload][b_side]} (pair {pair}): {type(exc).__name__}: {exc}"
            for log in sorted(workdir.glob("*.log")):
                print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
            break
        longest = max(longest, time.monotonic() - t_run)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    summary = report(rows, args)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "runs": rows, "summary": summary, "failed": failed}, indent=1)
        )
    if not args.logs:
        shutil.rmtree(root, ignore_errors=True)
    if failed:
        print(f"FAILED: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
