"""Small LoRA adapters for SmolLM2-135M-Instruct, made by the tests themselves with peft (no hub): random,
non-zero weights on the attention's q and v projections, large enough that greedy output changes."""

from __future__ import annotations

from pathlib import Path


def make_adapter(model_folder: str | Path, out: Path, seed: int = 0, rank: int = 8, alpha: int = 32) -> Path:
    """Write a PEFT LoRA adapter for the model in ``model_folder`` into ``out`` (its folder); return it.
    ``init_lora_weights=False`` draws both LoRA matrices at random (peft's default leaves B at zero,
    which changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32, local_files_only=True)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(out))
    return out
