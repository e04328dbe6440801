"""What a response_format costs the CPU engine: the time per generated token of the same requests
with and without a JSON schema (xgrammar's token bitmask filled and applied on every step), on the
real SmolLM2-135M-Instruct in this process, A B A B in one run.

Each round runs --streams concurrent chat requests, greedy, up to --max-tokens. A constrained answer
ends when its JSON value is complete, so the figure is the time per token after the first (decode
steps, without the prefill; the median over requests), not tokens per request. The first constrained round
also pays xgrammar's import and the schema's compilation, so a warm-up round of each side runs first.

  .venv/bin/python bench/constrained_cpu.py [--rounds 3] [--streams 1 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

from llamamesh.settings import WorkerSettings
from llamamesh.types import ChatMessage, ConstraintKind, GenerationRequest, ResponseConstraint, SamplingParams
from workers.engines.transformers import TransformersEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}


async def one(engine: TransformersEngine, i: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    """(seconds per token after the first, tokens) of one request: decode steps, without the prefill."""
    constraint = ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA)) if constrained else None
    req = GenerationRequest(
        request_id=uuid.uuid4().hex,
        model="m",
        messages=(ChatMessage("user", f"Describe person number {i} as JSON: name, age, hobbies, city."),),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=constraint),
    )
    first = last = 0.0
    n = 0
    async for delta in engine.stream(req):
        if delta.token_ids:
            last = time.perf_counter()
            first = first or last
            n += len(delta.token_ids)
    return (last - first) / max(n - 1, 1), n


async def round_(engine: TransformersEngine, streams: int, max_tokens: int, constrained: bool) -> dict:
    got = await asyncio.gather(*(one(engine, i, max_tokens, constrained) for i in range(streams)))
    return {"ms_per_token": statistics.median(s for s, _n in got) * 1e3, "tokens": sum(n for _s, n in got)}


async def main_async(a: argparse.Namespace) -> None:
    engine = TransformersEngine(WorkerSettings(threads=a.threads, max_inflight=max(a.streams)))
    await engine.start()
    try:
        for streams in a.streams:
            for constrained in (False, True):  # warm-up: compilation, xgrammar's import
                await round_(engine, streams, a.max_tokens, constrained)
            rows: dict[bool, list[dict]] = {False: [], True: []}
            for _ in range(a.rounds):
                for constrained in (False, True):
                    rows[constrained].append(await round_(engine, streams, a.max_tokens, constrained))
            free = statistics.median(r["ms_per_token"] for r in rows[False])
            json_ = statistics.median(r["ms_per_token"] for r in rows[True])
            print(
                json.dumps(
                    {
                        "streams": streams,
                        "threads": a.threads,
                        "rounds": a.rounds,
                        "free_ms_per_token": round(free, 2),
                        "schema_ms_per_token": round(json_, 2),
                        "ratio": round(json_ / free, 3),
                        "free_runs": [round(r["ms_per_token"], 2) for r in rows[False]],
                        "schema_runs": [round(r["ms_per_token"], 2) for r in rows[True]],
                        "schema_tokens": [r["tokens"] for r in rows[True]],
                    }
                ),
                flush=True,
            )
    finally:
        await engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
