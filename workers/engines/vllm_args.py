"""The vllm engine's arguments: WorkerSettings and VllmSettings as vLLM's ``AsyncEngineArgs`` and
``VllmConfig``, every error naming the setting at fault.

:func:`engine_kwargs` and the error classifiers are pure (testable without vLLM); :func:`engine_config`
imports ``vllm.engine.arg_utils.AsyncEngineArgs`` and ``vllm.usage.usage_lib.UsageContext`` (and
``torch`` for the default tensor parallel size) when called.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from llamamesh.errors import EngineDead, InvalidRequest
from llamamesh.settings import BatchSettings, VllmSettings, WorkerSettings, adapter_table, env_name

# VllmSettings fields forwarded when non-empty / non-zero / true.
_ENGINE_FIELDS = (
    "tokenizer",
    "dtype",
    "max_model_len",
    "gpu_memory_utilization",
    "block_size",
    "quantization",
    "load_format",
    "enforce_eager",
    "max_num_seqs",
    "max_num_batched_tokens",
    "swap_space",
    "seed",
    "scheduling_policy",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
)
SCHEDULING_POLICIES = ("priority", "fcfs")
# The step budget of a batch worker (max_num_batched_tokens 0 with LLAMAMESH_BATCH_MAX_SHARE 1): twice
# what offline ``LLM`` uses on an H100/H200 (16384). A batch then keeps up with offline LLM.generate,
# which offline's own budget and vLLM's server default (8192) fall short of, and a larger budget does
# not beat (docs/benchmarks.md, "A 1000-prompt batch against offline LLM.generate").
BATCH_STEP_TOKENS = 32768
# AsyncEngineArgs fields that come from WorkerSettings.
_FROM_WORKER = {"model": "model_path", "served_model_name": "model"}
SWAP_SPACE_GONE = (
    "vLLM 0.26's AsyncEngineArgs has no swap_space: the V1 engine recomputes preempted requests "
    "instead of swapping them to CPU; leave it 0 (for CPU KV offloading see kv_offloading_size, "
    "through LLAMAMESH_VLLM_EXTRA_ARGS)"
)


@dataclasses.dataclass(frozen=True)
class CoreClient:
    """How one of several frontend processes reaches an engine core that another process started
    (workers/engines/vllm_frontends.py): vLLM's ``client_config`` without count and index."""

    addresses: Mapping[str, Any]
    count: int
    index: int


def setting_of(key: str, extra_keys: Collection[str] = ()) -> str:
    """The settings field (``section.field``) an AsyncEngineArgs key came from."""
    if key in _FROM_WORKER:
        return f"worker.{_FROM_WORKER[key]}"
    if key in extra_keys:
        return "vllm.extra_args"
    return f"vllm.{key}"


def parse_extra_args(raw: str) -> dict[str, Any]:
    """``LLAMAMESH_VLLM_EXTRA_ARGS``: a JSON object, or empty."""
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest.field("vllm.extra_args", f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequest.field("vllm.extra_args", f"must be a JSON object, got {type(value).__name__}")
    return value


def for_worker(settings: VllmSettings, batch: BatchSettings) -> VllmSettings:
    """The vLLM settings with the step budget chosen from what the worker serves, when left 0: a
    batch worker (batch items may take all its slots: ``batch.max_share`` >= 1) gets BATCH_STEP_TOKENS
    (twice offline LLM's); any other keeps vLLM's server default (shorter steps, steadier interactive
    tokens)."""
    if settings.max_num_batched_tokens or batch.max_share < 1.0:
        return settings
    return dataclasses.replace(settings, max_num_batched_tokens=BATCH_STEP_TOKENS)


def engine_kwargs(worker: WorkerSettings, settings: VllmSettings, device_count: int) -> dict[str, Any]:
    """The AsyncEngineArgs keyword arguments for these settings: only the set ones, plus extra_args.

    ``device_count`` (the GPUs visible to the worker) is the tensor parallel size when the setting is 0.
    Raises InvalidRequest naming the settings field for what can be checked without vLLM.
    """
    _check_settings(worker, settings)
    kwargs: dict[str, Any] = {
        "model": worker.model_path,
        "served_model_name": worker.model,
        "tensor_parallel_size": settings.tensor_parallel_size or max(1, device_count),
    }
    for name in _ENGINE_FIELDS:
        value = getattr(settings, name)
        if value:
            kwargs[name] = value
    if settings.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = settings.enable_prefix_caching
    extra = parse_extra_args(settings.extra_args)
    owned = {f.name for f in dataclasses.fields(VllmSettings)} | set(_FROM_WORKER)
    for key in sorted(set(extra) & owned):
        section, _, field = setting_of(key).partition(".")
        raise InvalidRequest.field("vllm.extra_args", f"{key!r} has its own setting, {env_name(section, field)}")
    kwargs.update(extra)
    if adapter_table(worker.adapters):
        kwargs["enable_lora"] = True
    return kwargs


def _check_settings(worker: WorkerSettings, settings: VllmSettings) -> None:
    if not worker.model_path:
        raise InvalidRequest.field("worker.model_path", "the vllm engine needs a model folder or Hugging Face id")
    if settings.scheduling_policy not in SCHEDULING_POLICIES:
        raise InvalidRequest.field("vllm.scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")


def check_engine_fields(kwargs: Mapping[str, Any], known: Collection[str], extra_keys: Collection[str]) -> None:
    """Refuse keys AsyncEngineArgs does not have (known: its field names), naming the setting."""
    for key in kwargs:
        if key in known:
            continue
        if key == "swap_space":
            raise InvalidRequest.field("vllm.swap_space", SWAP_SPACE_GONE)
        raise InvalidRequest.field(setting_of(key, extra_keys), f"vLLM's AsyncEngineArgs has no field {key!r}")


def engine_error_field(message: str, locs: Sequence[str], keys: Collection[str], extra_keys: Collection[str]) -> str:
    """The setting a vLLM config error is about: a pydantic error location first, then the key the
    message names first; "vllm" when neither names one."""
    for loc in locs:
        if loc in keys:
            return setting_of(loc, extra_keys)
    named = [
        (m.start(), key)
        for key in keys
        if key not in _FROM_WORKER and (m := re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message))
    ]
    return setting_of(min(named)[1], extra_keys) if named else "vllm"


def engine_args(
    worker: WorkerSettings, settings: VllmSettings, device_count: int | None = None, core: CoreClient | None = None
) -> tuple[Any, dict[str, Any], set[str]]:
    """(AsyncEngineArgs, its keyword arguments, the keys from extra_args); InvalidRequest naming the
    setting at fault. ``device_count`` None: torch's count of the visible GPUs. With a ``core``, the
    arguments of one of its frontends (as vllm serve's API server processes set them)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    kwargs = engine_kwargs(worker, settings, device_count)
    extra = set(parse_extra_args(settings.extra_args))
    check_engine_fields(kwargs, {f.name for f in dataclasses.fields(AsyncEngineArgs)}, extra)
    try:
        args = AsyncEngineArgs(**kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest.field(engine_error_field(str(exc), [], kwargs, extra), str(exc)) from exc
    if core is not None:
        args._api_process_count = core.count
        args._api_process_rank = core.index
    return args, kwargs, extra


def engine_config(
    worker: WorkerSettings,
    settings: VllmSettings,
    device_count: int | None = None,
    core: CoreClient | None = None,
    api_processes: int = 1,
) -> tuple[Any, Any]:
    """(AsyncEngineArgs, VllmConfig) for these settings; ``api_processes`` > 1 when the caller starts
    the engine core for that many frontends (as ``vllm serve --api-server-count``).

    A bad engine argument raises InvalidRequest naming the setting (``vllm.<field>``); any other
    failure raises EngineDead."""
    from vllm.usage.usage_lib import UsageContext

    args, kwargs, extra = engine_args(worker, settings, device_count, core)
    if api_processes > 1:
        args._api_process_count = api_processes
        args._api_process_rank = -1
    try:
        config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except (TypeError, ValueError) as exc:
        errors = getattr(exc, "errors", None)
        locs = [str(e["loc"][-1]) for e in errors() if e.get("loc")] if callable(errors) else []
        raise InvalidRequest.field(engine_error_field(str(exc), locs, kwargs, extra), str(exc)) from exc
    except Exception as exc:
        raise EngineDead(f"cannot configure vLLM for {worker.model_path}: {type(exc).__name__}: {exc}") from exc
    return args, config
