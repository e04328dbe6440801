"""The price of batch invariance on the CPU engine: decode-step time with the fixed-shape row groups
(workers/engines/transformers_linear.py, LLAMAMESH_WORKER_BATCH_INVARIANT=true, the default) against
the libraries' own kernel choice (false), in one process, A B A B at each batch size.

    .venv/bin/python bench/row_groups.py --threads 1 --batches 1 4 8 16 32 --steps 20 --rounds 3

Each round builds a batch of B greedy sequences (the same chat prompt), lets it run 3 warm-up steps,
then times ``steps`` decode steps (one token per sequence each). Prints ms per step and tokens/s per
configuration (median over rounds), and the ratio invariant / free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamamesh.settings import WorkerSettings
from llamamesh.types import ChatMessage, GenerationRequest, SamplingParams
from workers.engines.params import resolve_sampling
from workers.engines.transformers_batch import Admission, Batch
from workers.engines.transformers_linear import _Grouped
from workers.engines.transformers_model import load


def admission(vocab: int) -> Admission:
    r = GenerationRequest(
        uuid.uuid4().hex,
        "m",
        messages=(ChatMessage("user", "Tell me a long story about the sea."),),
        sampling=SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
    )
    return Admission(r, resolve_sampling(r.sampling, vocab))


def time_steps(batch: Batch, size: int, steps: int) -> float:
    """Seconds per decode step of ``size`` sequences."""
    batch._seqs, batch._kv, batch._lengths = [], None, torch.zeros(0, dtype=torch.long)
    batch.step([admission(batch.vocab_size) for _ in range(size)], set())
    for _ in range(3):
        batch.step([], set())
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step([], set())
    return (time.perf_counter() - t0) / steps


def set_grouped(model: torch.nn.Module, on: bool) -> None:
    """Switch the row groups on or off on a model whose linears were switched once."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            grouped = m.__dict__.get("_llamamesh_grouped")
            if grouped is None:
                grouped = m._llamamesh_grouped = _Grouped(m)  # type: ignore[assignment]
            if on:
                m.forward = grouped  # type: ignore[method-assign,assignment]
            else:
                m.__dict__.pop("forward", None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    loaded = load("", WorkerSettings().cache_dir, args.dtype, args.threads)
    batch = Batch(loaded.model, loaded.tokenizer, 2048, row_groups=False)
    rows = []
    for size in args.batches:
        took: dict[str, list[float]] = {"invariant": [], "free": []}
        for _ in range(args.rounds):
            for name, on in (("invariant", True), ("free", False)):  # A B A B
                set_grouped(loaded.model, on)
                took[name].append(time_steps(batch, size, args.steps))
        inv, free = statistics.median(took["invariant"]), statistics.median(took["free"])
        rows.append(
            {
                "batch": size,
                "invariant_ms": round(inv * 1e3, 1),
                "free_ms": round(free * 1e3, 1),
                "invariant_tok_s": round(size / inv, 1),
                "free_tok_s": round(size / free, 1),
                "ratio": round(free / inv, 3),
            }
        )
    print(
        f"threads={args.threads} dtype={args.dtype} steps={args.steps} rounds={args.rounds} torch={torch.__version__}"
    )
    print("| batch | invariant ms/step | free ms/step | invariant tok/s | free tok/s | invariant / free (tok/s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['invariant_ms']} | {r['free_ms']} | {r['invariant_tok_s']} | "
            f"{r['free_tok_s']} | {r['ratio']} |"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in git: made on first use
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
