"""The offline peer of the batch benchmark: vLLM's ``LLM.generate`` on N random token prompts in this
process, the same workload bench/batch_gpu.py sends as one BatchGenerate (--input-len random token
ids in, --output-len tokens out with ignore_eos, temperature 1, --warmup-prompts first, untimed).

Prints ``[offline] ...`` lines, the last one ``[offline] RESULT {json}`` (output tok/s = completion
tokens / the wall time of the one ``generate`` call); ``--json`` also writes that result.

  python3 bench/offline_generate.py --model MODEL_DIR [--num-prompts 1000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

# Ids below this are the SmolLM2 tokenizer's special tokens: prompts keep to ordinary ids.
FIRST_ORDINARY_ID = 17


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder (config and tokenizer)")
    ap.add_argument("--load-format", default="dummy", help="vLLM's load_format (dummy: random weights)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warmup-prompts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm = LLM(model=a.model, load_format=a.load_format, dtype="bfloat16", seed=a.seed)
    t_init = time.perf_counter() - t1
    print(f"[offline] import {t_import:.1f} s, LLM() start-up {t_init:.1f} s", flush=True)

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(a.seed)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(a.input_len)])
        for _ in range(a.num_prompts)
    ]
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=a.output_len, ignore_eos=True, seed=None)
    if a.warmup_prompts:
        llm.generate(prompts[: a.warmup_prompts], sp, use_tqdm=False)
    t2 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t2
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    sched = llm.llm_engine.vllm_config.scheduler_config
    res = {
        "bench": "offline LLM.generate",
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "elapsed_s": elapsed,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "requests_per_s": a.num_prompts / elapsed,
        "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_in + n_out) / elapsed,
        "startup_s": t_init,
        "import_s": t_import,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": llm.llm_engine.model_config.max_model_len,
    }
    print("[offline] RESULT " + json.dumps(res), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
