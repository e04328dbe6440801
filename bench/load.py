"""Load generator for a llamamesh gateway: N concurrent streaming Generate calls over grpc.aio.

Random prompts of ``--input-len`` tokens (random token ids of the model's tokenizer, decoded to
text and adjusted until they re-tokenize to that length, as `vllm bench serve --dataset-name random`
does; the count the server saw comes back in usage and is reported),
``--output-len`` tokens each with ignore_eos, a fixed number of requests after warm-ups, closed
loop at ``--concurrency``. The load can be spread over ``--processes`` client processes so the
client is never the bottleneck. Reports output tok/s, total tok/s, TTFT, ITL and TPOT percentiles
(ITL = the gap between successive streamed messages that carry tokens, as vllm bench measures
between SSE chunks).

  python bench/load.py --address 127.0.0.1:50051 --tokenizer MODEL_DIR --concurrency 64 \
      --num-requests 512 --warmups 32 --json out.json

``--openai-url URL --model NAME`` drives an OpenAI-compatible server (``vllm serve``) with the same
loop, prompts and processes instead, streaming ``/v1/completions``: the same client on both sides.
``--records FILE`` keeps each request's start, TTFT and end, to see how the loop's requests bunch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from llamamesh.loop import serving_heap
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc


def make_prompts(tokenizer_dir: str, n: int, input_len: int, seed: int, repeat: bool = False) -> list[str]:
    """Random texts that tokenize to exactly ``input_len`` tokens, made as `vllm bench serve
    --dataset-name random` makes its prompts (random ids decoded, re-encoded, padded or cut, up to 10
    times), so both sides prefill the same number of tokens. ``repeat``: each is one random text of
    half that length written twice, which a model goes on copying (a speculative proposer's case)."""
    if repeat:
        return [p + p for p in make_prompts(tokenizer_dir, n, input_len // 2, seed)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    prompts = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        for _try in range(10):
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == input_len:
                break
            ids = ids[:input_len] + [rng.choice(vocab) for _ in range(input_len - len(ids))]
        prompts.append(tok.decode(ids))
    return prompts


async def stream_one(stub: Any, req: pb.GenerateRequest) -> tuple[dict, str]:
    """One streaming Generate call, recorded (times at the client; queue_ms / server_ttft_ms: the
    server's own view, gateway accept -> worker start / -> first token), and its text."""
    t0 = time.perf_counter()
    first = last = 0.0
    itl: list[float] = []
    ntok = 0
    usage = None
    text: list[str] = []
    timings = (float("nan"), float("nan"))
    async for m in stub.Generate(req):
        if m.token_ids:
            now = time.perf_counter()
            if not first:
                first = now
            else:
                itl.append(now - last)
            last = now
            ntok += len(m.token_ids)
        text.append(m.text)
        if m.HasField("usage"):
            usage = (m.usage.prompt_tokens, m.usage.completion_tokens)
        if m.HasField("timings"):
            t = m.timings
            timings = (t.queue_wait.ToNanoseconds() / 1e6, t.time_to_first_token.ToNanoseconds() / 1e6)
    return record(t0, first, last, itl, ntok, usage[0] if usage else 0, timings), "".join(text)


def record(
    t0: float, first: float, last: float, itl: list[float], ntok: int, prompt_tokens: int, timings: tuple[float, float]
) -> dict:
    """One request's record: client times (start, first and last token, the gaps between tokens), its
    token counts, and the server's own (queue wait, time to first token; NaN where it gives none)."""
    return {
        "start": t0,
        "ttft": first - t0,
        "itl": itl,
        "ntok": ntok,
        "e2e": last - t0,
        "end": last,
        "prompt_tokens": prompt_tokens,
        "queue_ms": timings[0],
        "server_ttft_ms": timings[1],
    }


async def _one(
    stub: Any, prompt: str, output_len: int, sem: asyncio.Semaphore, rec: list[dict], temperature: float = 1.0
) -> None:
    async with sem:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=output_len, ignore_eos=True, temperature=temperature)
        rec.append((await stream_one(stub, req))[0])


async def _one_openai(session: Any, url: str, body: dict, sem: asyncio.Semaphore, rec: list[dict]) -> None:
    """One streaming request to an OpenAI-compatible ``/v1/completions`` (``vllm serve``), recorded as
    ``_one`` records a Generate call (the server's own timings are not in its response: NaN)."""
    async with sem:
        t0 = time.perf_counter()
        first = last = 0.0
        itl: list[float] = []
        ntok = n_prompt = 0
        async with session.post(url, json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:  # SSE: one "data: {...}" line per chunk
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    ntok, n_prompt = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if first:
                        itl.append(now - last)
                    else:
                        first = now
                    last = now
        rec.append(record(t0, first, last, itl, ntok, n_prompt, (float("nan"), float("nan"))))


def completion_body(
    model: str,
    prompt: str,
    output_len: int,
    priority: int | None = None,
    stream: bool = True,
    temperature: float = 1.0,
) -> dict:
    """A ``/v1/completions`` body of the same request as ``_one``'s Generate."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": stream,
    }
    if priority is not None:
        body["priority"] = priority
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _run(
    target: str, prompts: list[str], concurrency: int, output_len: int, warm: list[str], temperature: float = 1.0
) -> dict:
    """Warm-ups, then the closed loop. ``target``: a gateway address, or ``openai:URL|MODEL`` for an
    OpenAI-compatible server driven by the same loop."""
    if target.startswith("openai:"):
        import aiohttp

        url, model = target[len("openai:") :].rsplit("|", 1)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=3600)
        )
        endpoint = url.rstrip("/") + "/v1/completions"

        def one(i: int, p: str, sem: asyncio.Semaphore, rec: list[dict]) -> Any:
            return _one_openai(
                session, endpoint, completion_body(model, p, output_len, temperature=temperature), sem, rec
            )

        async def close() -> None:
            await session.close()
    else:
        # One channel per 32 streams: HTTP/2 flow control and one TCP connection per channel.
        channels = [
            grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, concurrency // 32))
        ]
        stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in channels]

        def one(i: int, p: str, sem: asyncio.Semaphore, rec: list[dict]) -> Any:
            return _one(stubs[i % len(stubs)], p, output_len, sem, rec, temperature)

        async def close() -> None:
            for c in channels:
                await c.close()

    try:
        if warm:
            wrec: list[dict] = []
            wsem = asyncio.Semaphore(min(concurrency, len(warm)))
            await asyncio.gather(*(one(i, p, wsem, wrec) for i, p in enumerate(warm)))
        rec: list[dict] = []
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p, sem, rec) for i, p in enumerate(prompts)))
        return {"t0": t0, "rec": rec}
    finally:
        await close()


def _worker(args: tuple) -> dict:
    target, prompts, concurrency, output_len, warm, barrier_t, temperature = args
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # The tokenizer's and grpc's objects out of the collector's reach, and young objects collected
    # less often (full collections paused every stream of this client for 100-200 ms, as the
    # gateway's did; llamamesh/loop.py).
    serving_heap()
    while time.time() < barrier_t:  # all client processes start together
        time.sleep(0.001)
    return asyncio.run(_run(target, prompts, concurrency, output_len, warm, temperature))


def _proc_tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and each of its live descendants, keyed "pid:comm"."""
    stats: dict[int, tuple[int, str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        stats[int(d)] = (int(rest[1]), comm, (int(rest[11]) + int(rest[12])) / tick)
    keep, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _c, _t) in stats.items():
            if ppid == parent and pid not in keep:
                keep.add(pid)
                frontier.append(pid)
    return {f"{pid}:{stats[pid][1]}": stats[pid][2] for pid in sorted(keep) if pid in stats}


def cpu_cores(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> dict:
    """Cores used by each watched process tree over ``seconds`` (total and per process)."""
    out: dict[str, Any] = {}
    for name, procs in after.items():
        per = {k: (v - before[name].get(k, 0.0)) / seconds for k, v in procs.items()}
        out[name] = {"total": round(sum(per.values()), 2), **{k: round(v, 2) for k, v in per.items() if v >= 0.05}}
    return out


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
    e2e = [r["e2e"] * 1e3 for r in rec]
    n_out = sum(r["ntok"] for r in rec)
    n_in = sum(r["prompt_tokens"] for r in rec)
    return {
        "label": label,
        "concurrency": concurrency,
        "num_requests": len(rec),
        "duration_s": duration,
        "output_tokens": n_out,
        "prompt_tokens_mean": n_in / max(len(rec), 1),
        "output_tok_per_s": n_out / duration,
        "total_tok_per_s": (n_out + n_in) / duration,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        # TTFT split: client -> gateway accept, then queue wait (accept -> worker start), then worker start
        # -> first token (tokenisation, vLLM's queue, prefill); the rest is the way back to the client.
        "server_queue_ms_p50": pct([r["queue_ms"] for r in rec], 50),
        "server_ttft_ms_p50": pct([r["server_ttft_ms"] for r in rec], 50),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_mean": statistics.fmean(tpot) if tpot else float("nan"),
        # A closed loop's requests take the same time end to end on any frontend that keeps the engine's
        # throughput: a lower TTFT there comes with a higher TPOT (docs/benchmarks.md).
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "e2e_ms_p50": pct(e2e, 50),
        "e2e_ms_mean": statistics.fmean(e2e) if e2e else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument(
        "--openai-url",
        default="",
        help="drive an OpenAI-compatible server (vllm serve) at this URL instead, with the same loop",
    )
    ap.add_argument("--model", default="", help="with --openai-url: the model name it serves")
    ap.add_argument("--tokenizer", required=True, help="folder with the model's tokenizer")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=0, help="default: 8 x concurrency")
    ap.add_argument("--warmups", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--processes", type=int, default=1, help="client processes sharing the load")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeat", action="store_true", help="prompts of one random text written twice")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="of the prompts; give each run on one server its own: a repeated prompt is a prefix-cache hit",
    )
    ap.add_argument("--label", default="llamamesh")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    ap.add_argument(
        "--records",
        help="append each request's start, TTFT and end (s from the first start) as one JSON line to this file",
    )
    ap.add_argument(
        "--watch",
        action="append",
        default=[],
        metavar="NAME=PID",
        help="report the CPU cores this process and its children used while measuring",
    )
    a = ap.parse_args()
    if a.openai_url and not a.model:
        ap.error("--model is needed with --openai-url")
    target = f"openai:{a.openai_url}|{a.model}" if a.openai_url else a.address
    n = a.num_requests or 8 * a.concurrency
    prompts = make_prompts(a.tokenizer, n + a.warmups, a.input_len, a.seed, a.repeat)
    warm, main_prompts = prompts[: a.warmups], prompts[a.warmups :]
    p = max(1, a.processes)
    parts = [main_prompts[i::p] for i in range(p)]
    wparts = [warm[i::p] for i in range(p)]
    concs = [a.concurrency // p + (1 if i < a.concurrency % p else 0) for i in range(p)]
    watch = {name: int(pid) for name, pid in (w.split("=", 1) for w in a.watch)}
    # The window starts after the warm-ups: sample when the first process's main phase starts.
    start_at = time.time() + 2.0
    samples: list[tuple[float, dict[str, dict[str, float]]]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.5):
            samples.append((time.perf_counter(), {n: _proc_tree_cpu(pid) for n, pid in watch.items()}))

    sampler = threading.Thread(target=sample, daemon=True)
    if watch:
        sampler.start()
    if p == 1:
        outs = [_worker((target, parts[0], concs[0], a.output_len, wparts[0], 0.0, a.temperature))]
    else:
        with mp.get_context("spawn").Pool(p) as pool:
            outs = pool.map(
                _worker,
                [(target, parts[i], concs[i], a.output_len, wparts[i], start_at, a.temperature) for i in range(p)],
            )
    rec = [r for o in outs for r in o["rec"]]
    t0 = min(r["start"] for r in rec) if p == 1 else min(o["t0"] for o in outs)
    duration = max(r["end"] for r in rec) - t0
    res = summarise(rec, duration, a.label, a.concurrency)
    sampling.set()
    inside = [x for x in samples if t0 <= x[0] <= t0 + duration]
    if len(inside) >= 2:
        res["cpu_cores"] = cpu_cores(inside[0][1], inside[-1][1], inside[-1][0] - inside[0][0])
    print("[load] RESULT " + json.dumps(res), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    if a.records:
        rows = sorted([round(r["start"] - t0, 4), round(r["ttft"], 4), round(r["end"] - t0, 4)] for r in rec)
        Path(a.records).parent.mkdir(parents=True, exist_ok=True)
        with open(a.records, "a") as f:
            f.write(json.dumps({"label": a.label, "concurrency": a.concurrency, "start_ttft_end": rows}) + "\n")


if __name__ == "__main__":
    main()
