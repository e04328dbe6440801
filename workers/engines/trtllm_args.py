"""The trtllm engine's arguments: WorkerSettings and TrtllmSettings as TensorRT-LLM's ``LLM(...)``,
``KvCacheConfig`` and ``LoraConfig`` keyword arguments, errors naming the setting at fault; and the
TensorRT-LLM names the engine imports at start (:class:`Api`).

Written from TensorRT-LLM's documentation and source only, never run against it (see trtllm.py).
The mappings are pure (testable without TensorRT-LLM); :class:`Api` imports ``tensorrt_llm``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from llamamesh.errors import EngineDead, InvalidRequest
from llamamesh.settings import TrtllmSettings, WorkerSettings, adapter_table

BACKENDS = ("pytorch", "tensorrt")
NOT_INSTALLED = (
    "tensorrt_llm is not installed: the trtllm engine needs it in the worker image "
    "(the trtllm extra; see NVIDIA's TensorRT-LLM installation guide)"
)
# TrtllmSettings fields forwarded to LLM(...) under their own name when non-empty / non-zero / true.
_LLM_FIELDS = ("tokenizer", "dtype", "max_seq_len", "max_batch_size", "max_num_tokens", "trust_remote_code")


def llm_kwargs(worker: WorkerSettings, settings: TrtllmSettings, device_count: int) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments for these settings (without ``kv_cache_config``): only the set
    ones. ``device_count`` (the GPUs visible to the worker) is the tensor parallel size when the setting
    is 0 on the pytorch backend; an engine directory keeps the parallelism it was built with.
    Raises InvalidRequest naming the settings field for what can be checked without TensorRT-LLM.

    ``LLM(model=, tokenizer=, tensor_parallel_size=, dtype=, trust_remote_code=, max_seq_len=, max_batch_size=,
    max_num_tokens=, enable_chunked_prefill=, kv_cache_config=, enable_iter_perf_stats=)``: the explicit
    arguments of ``BaseLLM.__init__`` and ``BaseLlmArgs`` / ``TorchLlmArgs`` fields; an unknown keyword
    raises ValueError ("got invalid argument"), which :func:`setting_of` names
    (tensorrt_llm/llmapi/llm.py, tensorrt_llm/llmapi/llm_args.py;
    https://nvidia.github.io/TensorRT-LLM/llm-api/reference/TorchLlmArgs.html)."""
    if not worker.model_path:
        raise InvalidRequest.field(
            "worker.model_path", "the trtllm engine needs a checkpoint folder, id or engine directory"
        )
    if settings.backend not in BACKENDS:
        raise InvalidRequest.field("trtllm.backend", f"must be one of {', '.join(BACKENDS)}")
    kwargs: dict[str, Any] = {"model": worker.model_path}
    if settings.tensor_parallel_size:
        kwargs["tensor_parallel_size"] = settings.tensor_parallel_size
    elif settings.backend == "pytorch":
        kwargs["tensor_parallel_size"] = max(1, device_count)
    for name in _LLM_FIELDS:
        value = getattr(settings, name)
        if value:
            kwargs[name] = value
    if settings.backend == "pytorch":
        # stats() needs TensorRT-LLM's iteration stats; the PyTorch backend keeps them only when asked
        # (the docs warn of a slight cost: docs/source/commands/trtllm-serve.rst, "Metrics Endpoint").
        # The TensorRT backend has them on and no such field.
        kwargs["enable_iter_perf_stats"] = True
        # response_format: guided decoding needs its backend chosen when the LLM is built (the LLM API
        # docs' guided decoding example); unverified here, like the rest of this adapter.
        kwargs["guided_decoding_backend"] = "xgrammar"
    # Without chunked prefill (TensorRT-LLM's default: off) a prompt longer than max_num_tokens (8192)
    # is refused (llm.py ``_check_arguments``); an engine directory needs it built in, so it is asked
    # there only when set.
    if settings.enable_chunked_prefill is not None or settings.backend == "pytorch":
        kwargs["enable_chunked_prefill"] = settings.enable_chunked_prefill is not False
    return kwargs


def lora_kwargs(worker: WorkerSettings, settings: TrtllmSettings) -> dict[str, Any] | None:
    """``LoraConfig`` keyword arguments (``lora_dir=, max_lora_rank=, max_loras=, max_cpu_loras=,
    lora_target_modules=``: https://nvidia.github.io/TensorRT-LLM/features/lora.html, the PyTorch
    backend), or None when LoRA is off: the worker's own adapters (LLAMAMESH_WORKER_ADAPTERS) go in
    ``lora_dir``; InvalidRequest names a bad setting."""
    own = adapter_table(worker.adapters)
    if not own and not settings.enable_lora:
        return None
    if settings.backend != "pytorch":
        raise InvalidRequest.field("trtllm.enable_lora", "LoRA adapters need the pytorch backend here")
    kwargs: dict[str, Any] = {}
    if own:
        kwargs["lora_dir"] = list(own.values())
    for name in ("max_loras", "max_cpu_loras", "max_lora_rank"):
        if value := getattr(settings, name):  # (the settings refuse negative counts)
            kwargs[name] = value
    modules = [m.strip() for m in settings.lora_target_modules.split(",") if m.strip()]
    if modules:
        kwargs["lora_target_modules"] = modules
    elif len(own) != 1:
        # TensorRT-LLM infers the target modules from exactly one lora_dir and asserts that they are
        # given otherwise (tensorrt_llm/_torch/pyexecutor/_util.py, its LoRA set-up): say so at start.
        raise InvalidRequest.field(
            "trtllm.lora_target_modules",
            f"set it (e.g. attn_q,attn_k,attn_v): TensorRT-LLM infers the modules from one adapter of "
            f"LLAMAMESH_WORKER_ADAPTERS only, and this worker lists {len(own)}",
        )
    return kwargs


def kv_cache_kwargs(settings: TrtllmSettings) -> dict[str, Any]:
    """``KvCacheConfig(free_gpu_memory_fraction=, enable_block_reuse=)`` keyword arguments
    (tensorrt_llm/llmapi/llm_args.py): only the set ones (empty: TensorRT-LLM's default config)."""
    kwargs: dict[str, Any] = {}
    if fraction := settings.free_gpu_memory_fraction:  # (the settings keep it in [0, 1])
        kwargs["free_gpu_memory_fraction"] = fraction
    if settings.enable_block_reuse is not None:
        kwargs["enable_block_reuse"] = settings.enable_block_reuse
    return kwargs


def setting_of(message: str, keys: Sequence[str]) -> str:
    """The setting a TensorRT-LLM argument error is about: the key the message names first."""
    named = [(m.start(), key) for key in keys if (m := re.search(rf"(?<!\w){re.escape(key)}(?!\w)", message))]
    if not named:
        return "trtllm"
    key = min(named)[1]
    return "worker.model_path" if key == "model" else f"trtllm.{key}"


class Api:
    """The TensorRT-LLM names the engine uses, imported once by :meth:`TrtllmEngine.start`: from
    ``tensorrt_llm.llmapi``, ``LLM``, ``SamplingParams``, ``GuidedDecodingParams``, ``KvCacheConfig``,
    ``RequestError`` (tensorrt_llm/llmapi/__init__.py); for a directory of built engines (the
    tensorrt backend), ``tensorrt_llm._tensorrt_engine.LLM`` instead (tensorrt_llm/_tensorrt_engine/
    __init__.py; the PyTorch ``LLM`` refuses TensorRT-only arguments and points there,
    tensorrt_llm/llmapi/llm.py ``_validate_args_for_torch_backend``)."""

    def __init__(self, backend: str) -> None:
        try:
            import tensorrt_llm.llmapi as llmapi

            if backend == "tensorrt":
                from tensorrt_llm._tensorrt_engine import LLM
            else:
                LLM = llmapi.LLM
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "tensorrt_llm":
                raise EngineDead(NOT_INSTALLED) from exc
            raise EngineDead(f"cannot import tensorrt_llm: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # CUDA / MPI libraries missing surface as all sorts of errors
            raise EngineDead(f"cannot import tensorrt_llm: {type(exc).__name__}: {exc}") from exc
        self.LLM = LLM
        self.SamplingParams = llmapi.SamplingParams
        self.GuidedDecodingParams = llmapi.GuidedDecodingParams
        self.KvCacheConfig = llmapi.KvCacheConfig
        self.RequestError: type[BaseException] = llmapi.RequestError

    @staticmethod
    def lora() -> tuple[Any, Any]:
        """(LoraConfig, LoRARequest), imported only when LoRA is on (the paths of TensorRT-LLM's LoRA docs:
        ``tensorrt_llm.lora_manager.LoraConfig`` as ``LLM(lora_config=)``,
        ``tensorrt_llm.executor.request.LoRARequest(name, int_id, path)`` per request)."""
        from tensorrt_llm.executor.request import LoRARequest
        from tensorrt_llm.lora_manager import LoraConfig

        return LoraConfig, LoRARequest
