"""What a wave of new requests costs the GPU adapters' tokenizer thread: N prompts encoded one call
each (an adapter that does not batch) against the same prompts in the batches that
``workers.engines.prompts.BatchTokenizer`` makes (one call of the tokenizer on a list), A B A B in one
process, with a check that both give the same ids. Prompts as bench/load.py makes them (random token
ids decoded, --input-len tokens).

    python bench/tokenize_batch.py --tokenizer DIR [--wave 64] [--input-len 512] [--rounds 5]

Prints, per round, the milliseconds of each side for the whole wave (the last request's wait).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import make_prompts

from llamamesh.types import GenerationRequest
from workers.engines.prompts import MAX_BATCH, render_batch, render_prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a folder with a Hugging Face tokenizer")
    ap.add_argument("--wave", type=int, default=64, help="requests arriving together")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    rows = []
    for r in range(a.rounds):
        texts = make_prompts(a.tokenizer, a.wave, a.input_len, seed=1000 + r)
        reqs = [GenerationRequest(request_id=str(i), model="m", prompt=t) for i, t in enumerate(texts)]
        t0 = time.perf_counter()
        one = [render_prompt_ids(q, tok) for q in reqs]
        t1 = time.perf_counter()
        batched: list = []
        for i in range(0, len(reqs), MAX_BATCH):
            batched += render_batch(reqs[i : i + MAX_BATCH], tok)
        t2 = time.perf_counter()
        assert batched == one, "a batch gave other ids than one call each"
        rows.append({"round": r, "one_each_ms": round((t1 - t0) * 1e3, 1), "batched_ms": round((t2 - t1) * 1e3, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(
        json.dumps(
            {
                "wave": a.wave,
                "input_len": a.input_len,
                "cpus": os.cpu_count(),
                "one_each_ms_median": statistics.median(x["one_each_ms"] for x in rows),
                "batched_ms_median": statistics.median(x["batched_ms"] for x in rows),
                "same_ids": True,
            }
        )
    )


if __name__ == "__main__":
    main()
