"""The GPU engine: vLLM 0.26's ``AsyncLLM`` in this process, streaming DELTA outputs.

The mapping between llamamesh and vLLM is pure functions over plain data (:func:`engine_kwargs`,
:func:`sampling_kwargs`, :func:`delta_of`, :func:`finish_reason_of`, the error classifiers; what both
GPU adapters share, in adapter.py), testable without vLLM; :class:`VllmEngine` is the thin layer that
builds vLLM objects from them, on the stream skeleton it shares with TensorRT-LLM's
(adapter.LibraryEngine). ``vllm`` is imported only inside :meth:`VllmEngine.start`
(this module itself is imported only when the registry picks the engine).

vLLM 0.26.0 APIs used, and nothing else:

- ``vllm.engine.arg_utils.AsyncEngineArgs`` (its dataclass fields, ``create_engine_config``,
  ``disable_log_stats``, ``enable_log_requests``)
- ``vllm.usage.usage_lib.UsageContext.OPENAI_API_SERVER`` (the scheduler defaults of ``vllm serve``)
- ``vllm.v1.engine.async_llm.AsyncLLM``: ``from_vllm_config(stat_loggers=...)``, ``generate``,
  ``abort``, ``check_health``, ``errored``, ``get_tokenizer``, ``do_log_stats``, ``shutdown``,
  ``model_config.max_model_len``, ``model_config.get_vocab_size()``,
  ``vllm_config.scheduler_config.max_num_seqs``
- ``vllm.sampling_params.SamplingParams``, ``StructuredOutputsParams`` (a response_format) and
  ``RequestOutputKind.DELTA``
- ``vllm.inputs.tokens_input`` (an already-tokenized prompt; vLLM does no tokenization of its own)
- ``vllm.outputs.RequestOutput`` / ``CompletionOutput`` fields: ``finished``, ``prompt_token_ids``,
  ``outputs[0]`` ``.text`` / ``.token_ids`` / ``.logprobs`` (``{token_id: Logprob(logprob, rank, ...)}``
  per token) / ``.finish_reason`` / ``.stop_reason``
- ``vllm.v1.engine.exceptions.EngineDeadError`` and ``EngineGenerateError``; ``ValueError`` (and its
  subclass ``vllm.exceptions.VLLMValidationError``, read through its ``parameter`` attribute)
- ``vllm.v1.metrics.loggers.StatLoggerBase`` (``record(scheduler_stats, ...)`` with ``SchedulerStats``
  ``num_running_reqs``, ``num_waiting_reqs``, ``num_skipped_waiting_reqs``, ``kv_cache_usage``)
- ``vllm.envs.VLLM_LOG_STATS_INTERVAL``

(and ``torch.cuda.device_count()`` for the default tensor parallel size). The tokenizer vLLM returns is
used through its Hugging Face surface: ``chat_template``, ``apply_chat_template``, ``encode``.

``start()`` builds the engine on the event loop thread, as ``vllm serve`` does: it blocks the loop
until the model is loaded (the worker does not lease before that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Collection, Mapping, Sequence
from typing import Any

import structlog

from llamamesh.errors import EngineDead, InternalError, InvalidRequest, PromptTooLong
from llamamesh.settings import BatchSettings, VllmSettings, WorkerSettings, adapter_table, env_name
from llamamesh.types import (
    FinishReason,
    GenerationRequest,
    ResponseConstraint,
    SamplingParams,
    TokenDelta,
)
from workers.engines import adapter
from workers.engines.adapter import (
    SAMPLING_FIELDS,
    LibraryEngine,
    cancel_task,
    check_prompt_tokens,
    lora_id,
    token_logprobs,
)
from workers.engines.base import EngineStats
from workers.engines.constraints import constraint_error, library_constraint, vllm_structured
from workers.engines.params import library_sampling_kwargs

log = structlog.get_logger(__name__)

# Where our defaults differ from vLLM's (max_tokens 16), they follow the CPU engine.
# Our SamplingParams fields passed to vLLM only when set (same names on both sides).
_OPTIONAL_SAMPLING = (
    "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "ignore_eos", "min_tokens", "logprobs", "n",
)  # fmt: skip

# VllmSettings fields forwarded when non-empty / non-zero / true.
_ENGINE_FIELDS = (
    "tokenizer", "dtype", "max_model_len", "gpu_memory_utilization", "block_size", "quantization",
    "load_format", "enforce_eager", "max_num_seqs", "max_num_batched_tokens", "swap_space", "seed",
    "scheduling_policy", "enable_lora", "max_loras", "max_lora_rank",
)  # fmt: skip
SCHEDULING_POLICIES = ("priority", "fcfs")
# The step budget of a batch worker (max_num_batched_tokens 0 with LLAMAMESH_BATCH_MAX_SHARE 1): twice
# what offline ``LLM`` uses on an H100/H200 (16384). On one H200 a 1000-prompt batch at 512 in / 128 out
# reached 0.90-0.95x of offline LLM.generate with 16384 and 1.0x with 32768 (65536 was no better); the
# server default, 8192, gave 0.94x on two GPUs (docs/benchmarks.md, issue 19 part 3).
BATCH_STEP_TOKENS = 32768
# Added to a batch item's vLLM priority (lower runs first) so that every interactive request, whatever
# its own priority, is admitted before any batch item.
BATCH_PRIORITY_OFFSET = 1 << 20
# AsyncEngineArgs fields that come from WorkerSettings.
_FROM_WORKER = {"model": "model_path", "served_model_name": "model"}
SWAP_SPACE_GONE = (
    "vLLM 0.26's AsyncEngineArgs has no swap_space: the V1 engine recomputes preempted requests "
    "instead of swapping them to CPU; leave it 0 (for CPU KV offloading see kv_offloading_size, "
    "through LLAMAMESH_VLLM_EXTRA_ARGS)"
)
_PROMPT_TOO_LONG = re.compile(r"prompt.*longer than the maximum model length", re.S)


# --- engine arguments


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


def engine_priority(request: GenerationRequest, policy: str) -> int:
    """vLLM's priority for a request (lower is scheduled first): ours negated (higher GenerateRequest
    priority first), and every batch item after every interactive request. 0 under fcfs, where vLLM
    refuses any other value."""
    if policy != "priority":
        return 0
    return -request.priority + (BATCH_PRIORITY_OFFSET if request.batch_id else 0)


def engine_kwargs(worker: WorkerSettings, settings: VllmSettings, device_count: int) -> dict[str, Any]:
    """The AsyncEngineArgs keyword arguments for these settings: only the set ones, plus extra_args.

    ``device_count`` (the GPUs visible to the worker) is the tensor parallel size when the setting is 0.
    Raises InvalidRequest naming the settings field for what can be checked without vLLM.
    """
    if not worker.model_path:
        raise InvalidRequest.field("worker.model_path", "the vllm engine needs a model folder or Hugging Face id")
    if settings.frontends < 1:
        raise InvalidRequest.field("vllm.frontends", "must be >= 1")
    if settings.tensor_parallel_size < 0:
        raise InvalidRequest.field("vllm.tensor_parallel_size", "must be >= 1, or 0 for every visible GPU")
    kwargs: dict[str, Any] = {
        "model": worker.model_path,
        "served_model_name": worker.model,
        "tensor_parallel_size": settings.tensor_parallel_size or max(1, device_count),
    }
    for name in _ENGINE_FIELDS:
        value = getattr(settings, name)
        if value:
            kwargs[name] = value
    if settings.scheduling_policy not in SCHEDULING_POLICIES:
        raise InvalidRequest.field("vllm.scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}")
    prefix_caching = settings.enable_prefix_caching.strip().lower()
    if prefix_caching in ("true", "false"):
        kwargs["enable_prefix_caching"] = prefix_caching == "true"
    elif prefix_caching:
        raise InvalidRequest.field("vllm.enable_prefix_caching", "must be true, false, or empty for vLLM's default")
    extra = parse_extra_args(settings.extra_args)
    owned = {f.name for f in dataclasses.fields(VllmSettings)} | set(_FROM_WORKER)
    for key in sorted(set(extra) & owned):
        section, _, field = setting_of(key).partition(".")
        raise InvalidRequest.field("vllm.extra_args", f"{key!r} has its own setting, {env_name(section, field)}")
    kwargs.update(extra)
    if adapter_table(worker.adapters):
        kwargs["enable_lora"] = True
    return kwargs


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


# --- requests


def sampling_kwargs(params: SamplingParams, vocab_size: int | None = None) -> dict[str, Any]:
    """vLLM SamplingParams keyword arguments (without ``output_kind``): max_tokens and temperature
    always (our defaults), every other field only when set; top_k -1 or 0 becomes vLLM's 0 (off).
    Stop token ids must lie in the vocabulary when its size is given."""
    return library_sampling_kwargs(params, _OPTIONAL_SAMPLING, vocab_size)


def invalid_from_vllm(message: str, parameter: str | None, input_field: str) -> InvalidRequest:
    """A vLLM validation error (SamplingParams or generate) as our error, naming our field."""
    if _PROMPT_TOO_LONG.search(message):
        return PromptTooLong.field(input_field, message)
    if parameter in SAMPLING_FIELDS:
        return InvalidRequest.field(parameter, message)
    first = re.match(r"\W*(\w+)", message)
    if first is not None and first.group(1) in SAMPLING_FIELDS:
        return InvalidRequest.field(first.group(1), message)
    if "prompt" in message or "Token id" in message:
        return InvalidRequest.field(input_field, message)
    return InvalidRequest.field("request", message)


def check_prompt_len(n_tokens: int, max_model_len: int, input_field: str) -> None:
    """vLLM needs at least one token of room for the output (it checks too; this names our field)."""
    check_prompt_tokens(n_tokens, max_model_len, input_field, "max_model_len")


# --- outputs


def finish_reason_of(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    """vLLM's finish_reason/stop_reason as ours (adapter.finish_reason_of): "abort" is CANCELLED,
    "repetition" (only with repetition_detection, which we never set) STOP; "error" (a request-level
    engine failure) raises InternalError."""
    return adapter.finish_reason_of(reason, stop_reason, engine="vLLM", cancelled="abort", also_stop=("repetition",))


def delta_of(output: Any, n_logprobs: int | None) -> TokenDelta:
    """One vLLM RequestOutput (DELTA kind, one completion) as a TokenDelta; the final one carries
    prompt_tokens = len(prompt_token_ids)."""
    if not output.outputs:
        return TokenDelta()
    return _completion_delta(output, output.outputs[0], n_logprobs)


def deltas_of(output: Any, n_logprobs: int | None) -> list[TokenDelta]:
    """Every completion of one vLLM RequestOutput (DELTA kind) as a TokenDelta of its sample
    (``CompletionOutput.index``: with n > 1, an output holds the samples that moved since the last)."""
    return [_completion_delta(output, c, n_logprobs) for c in output.outputs]


def _completion_delta(output: Any, completion: Any, n_logprobs: int | None) -> TokenDelta:
    reason = finish_reason_of(completion.finish_reason, completion.stop_reason)
    ids = tuple(completion.token_ids)
    return TokenDelta(
        text=completion.text,
        token_ids=ids,
        logprobs=token_logprobs(ids, completion.logprobs, n_logprobs),
        finish_reason=reason,
        prompt_tokens=len(output.prompt_token_ids or ()) if reason is not None else None,
        sample=getattr(completion, "index", 0) or 0,
    )


def engine_timings(output: Any, tokenize_ms: float, now: float | None = None) -> tuple[tuple[str, float], ...]:
    """Where a finished request's time went: our tokenisation, then vLLM's own view
    (``RequestOutput.metrics``, a ``RequestStateStats`` when stats are on): arrival in vLLM → first
    token, waiting in the scheduler's queue, prefill (first scheduled → first token), decode (first →
    last token), and delivery: from the engine core's last token to ``now`` (``time.monotonic()``,
    when this frontend handed over the final output; one clock for every process of the host)."""
    out = [("tokenize", round(tokenize_ms, 2))]
    m = getattr(output, "metrics", None)
    if m is not None and getattr(m, "first_token_ts", None):
        out.append(("vllm_ttft", round(m.first_token_latency * 1e3, 2)))
        if getattr(m, "queued_ts", None) and getattr(m, "scheduled_ts", None):  # 0: the engine core's stats off
            out += [
                ("vllm_queue", round((m.scheduled_ts - m.queued_ts) * 1e3, 2)),
                ("vllm_prefill", round((m.first_token_ts - m.scheduled_ts) * 1e3, 2)),
            ]
        if getattr(m, "last_token_ts", None):
            now = time.monotonic() if now is None else now
            out += [
                ("vllm_decode", round((m.last_token_ts - m.first_token_ts) * 1e3, 2)),
                ("vllm_delivery", round((now - m.last_token_ts) * 1e3, 2)),
            ]
    return tuple(out)


class SchedulerSnapshot:
    """The latest scheduler figures of each vLLM engine core (fed by a vLLM stat logger)."""

    def __init__(self) -> None:
        self._by_engine: dict[int, tuple[int, int, float]] = {}

    def record(self, engine_idx: int, running: int, waiting: int, kv_cache_usage: float) -> None:
        self._by_engine[engine_idx] = (running, waiting, kv_cache_usage)

    def stats(self) -> EngineStats:
        if not self._by_engine:
            return EngineStats()
        rows = self._by_engine.values()
        return EngineStats(
            running=sum(r[0] for r in rows),
            waiting=sum(r[1] for r in rows),
            kv_cache_usage=sum(r[2] for r in rows) / len(rows),
        )


def _stat_logger_factory(snapshot: SchedulerSnapshot) -> Any:
    """A per-engine vLLM stat logger factory keeping ``snapshot`` up to date (vLLM's own loggers stay)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SnapshotStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                snapshot.record(
                    engine_idx,
                    scheduler_stats.num_running_reqs,
                    scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                    scheduler_stats.kv_cache_usage,
                )

        def log_engine_initialized(self) -> None:
            pass

    return lambda vllm_config, engine_index: SnapshotStatLogger(vllm_config, engine_index)


# --- the engine


@dataclasses.dataclass(frozen=True)
class CoreClient:
    """How one of several frontend processes reaches an engine core that another process started
    (see workers/engines/vllm_frontends.py): vLLM's ``client_config`` without count and index."""

    addresses: Mapping[str, Any]
    count: int
    index: int


@dataclasses.dataclass
class _Stream:
    aborted: bool = False


class _Vllm:
    """The vLLM names the engine uses, imported once by :meth:`VllmEngine.start`."""

    def __init__(self) -> None:
        import vllm.envs
        from vllm.inputs import tokens_input
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        self.tokens_input = tokens_input
        self.LoRARequest = LoRARequest
        self.SamplingParams = SamplingParams
        self.StructuredOutputsParams = StructuredOutputsParams
        self.DELTA = RequestOutputKind.DELTA
        self.EngineDeadError: type[BaseException] = EngineDeadError
        self.EngineGenerateError: type[BaseException] = EngineGenerateError
        self.log_stats_interval_s = float(vllm.envs.VLLM_LOG_STATS_INTERVAL)


class VllmEngine(LibraryEngine):
    """Serves one model with vLLM's AsyncLLM. Attributes tests can assert: ``aborted`` (request ids
    aborted, by :meth:`abort` or by a consumer that went away). ``tokenize``, ``stream`` and ``abort``
    are adapter.LibraryEngine's, around ``AsyncLLM.generate`` (one DELTA output per step): if the
    consumer goes away, closing generate() makes vLLM abort the request itself."""

    library = "vLLM"
    # SamplingParams.n: the prompt is prefilled once and each sample's deltas carry its index
    # (workers/samples.py runs the other engines' samples one request each).
    parallel_samples = True

    def __init__(
        self,
        settings: WorkerSettings,
        vllm: VllmSettings,
        device_count: int | None = None,
        core: CoreClient | None = None,
    ) -> None:
        super().__init__(settings)
        self._vllm_settings = vllm
        self._policy = vllm.scheduling_policy
        self._device_count = device_count
        self._core = core
        self._max_model_len = 0
        self._vocab_size: int | None = None
        self._snapshot = SchedulerSnapshot()
        self._log_task: asyncio.Task[None] | None = None
        if vllm.max_num_seqs:
            self._warn_if_underfed(vllm.max_num_seqs)

    @property
    def starting(self) -> str:
        return self._starting

    # --- LoRA adapters (vLLM's LoRARequest; tested on an H200 with vLLM 0.26: tests/e2e/test_node.py).
    # vLLM loads an adapter into the engine core at load_adapter, or at its first request.

    async def load_adapter(self, name: str, path: str) -> None:
        """Load an adapter into the engine core now (vLLM's add_lora); InvalidRequest if vLLM refuses
        it (LoRA off: LLAMAMESH_VLLM_ENABLE_LORA; a rank above max_lora_rank; not a PEFT folder)."""
        llm, api = self._started()
        if name in self._adapters:
            return
        try:
            await llm.add_lora(api.LoRARequest(name, lora_id(name), path))
        except (ValueError, RuntimeError, OSError) as exc:
            raise InvalidRequest.field("adapter", f"vLLM cannot load adapter {name!r} from {path!r}: {exc}") from exc
        self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        llm, _api = self._started()
        if self._adapters.pop(name, None) is not None:
            await llm.remove_lora(lora_id(name))

    # --- lifecycle

    def _engine_args(self) -> tuple[Any, dict[str, Any], set[str]]:
        """AsyncEngineArgs from the settings; InvalidRequest naming the setting at fault."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        device_count = self._device_count
        if device_count is None:
            import torch

            device_count = torch.cuda.device_count()
        kwargs = engine_kwargs(self._settings, self._vllm_settings, device_count)
        extra = set(parse_extra_args(self._vllm_settings.extra_args))
        check_engine_fields(kwargs, {f.name for f in dataclasses.fields(AsyncEngineArgs)}, extra)
        try:
            args = AsyncEngineArgs(**kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest.field(engine_error_field(str(exc), [], kwargs, extra), str(exc)) from exc
        if self._core is not None:  # as vllm serve's API server processes do
            args._api_process_count = self._core.count
            args._api_process_rank = self._core.index
        return args, kwargs, extra

    def engine_config(self, api_processes: int = 1) -> tuple[Any, Any]:
        """(AsyncEngineArgs, VllmConfig) for these settings; ``api_processes`` > 1 when the caller starts
        the engine core for that many frontends (as ``vllm serve --api-server-count``).

        A bad engine argument raises InvalidRequest naming the setting (``vllm.<field>``); any other
        failure raises EngineDead."""
        from vllm.usage.usage_lib import UsageContext

        engine_args, kwargs, extra = self._engine_args()
        if api_processes > 1:
            engine_args._api_process_count = api_processes
            engine_args._api_process_rank = -1
        try:
            config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        except (TypeError, ValueError) as exc:
            errors = getattr(exc, "errors", None)
            locs = [str(e["loc"][-1]) for e in errors() if e.get("loc")] if callable(errors) else []
            raise InvalidRequest.field(engine_error_field(str(exc), locs, kwargs, extra), str(exc)) from exc
        except Exception as exc:
            self._dead = f"cannot configure vLLM for {self._settings.model_path}: {type(exc).__name__}: {exc}"
            raise EngineDead(self._dead) from exc
        return engine_args, config

    async def start(self) -> None:
        """Build vLLM's config and engine (loads the model, blocking the loop meanwhile, as ``vllm serve``;
        with a ``core`` it connects to an engine core another process started).

        A bad engine argument raises InvalidRequest naming the setting (``vllm.<field>``); any other
        failure to load raises EngineDead."""
        if self._llm is not None:
            return
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self._starting = "configuring vLLM"
        api = _Vllm()
        engine_args, config = self.engine_config()
        if not self._vllm_settings.max_num_seqs:  # else __init__ warned already
            self._warn_if_underfed(config.scheduler_config.max_num_seqs)
        self._starting = "starting vLLM (weights, memory profile, CUDA graphs)"
        try:
            core = self._core
            llm = AsyncLLM.from_vllm_config(
                config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=[_stat_logger_factory(self._snapshot)],
                enable_log_requests=engine_args.enable_log_requests,
                disable_log_stats=engine_args.disable_log_stats,
                client_addresses=dict(core.addresses) if core is not None else None,
                client_count=core.count if core is not None else 1,
                client_index=core.index if core is not None else 0,
            )
            tokenizer = llm.get_tokenizer()
        except Exception as exc:
            self._dead = f"cannot start vLLM with {self._settings.model_path}: {type(exc).__name__}: {exc}"
            raise EngineDead(self._dead) from exc
        finally:
            self._starting = ""
        self._llm, self._api, self._tokenizer = llm, api, tokenizer
        self._max_model_len = int(llm.model_config.max_model_len)
        self._vocab_size = int(llm.model_config.get_vocab_size())
        if not engine_args.disable_log_stats:
            # vLLM's periodic throughput line, as `vllm serve` prints it.
            self._log_task = asyncio.create_task(self._log_stats(api.log_stats_interval_s), name="vllm-log-stats")
        log.info("vllm_started", model=self._settings.model_path, max_model_len=self._max_model_len,
                 max_num_seqs=config.scheduler_config.max_num_seqs,
                 tensor_parallel_size=config.parallel_config.tensor_parallel_size)  # fmt: skip

    def _warn_if_underfed(self, max_num_seqs: int) -> None:
        if self._core is not None and self._core.index > 0:
            return  # frontend 0 speaks for all
        total = self._settings.max_inflight * (self._core.count if self._core is not None else 1)
        if total < max_num_seqs:
            log.warning(
                "vllm_underfed",
                max_inflight=total,
                max_num_seqs=max_num_seqs,
                hint="set LLAMAMESH_WORKER_MAX_INFLIGHT >= max_num_seqs so the worker keeps vLLM's batch full",
            )

    async def _log_stats(self, interval_s: float) -> None:
        """Owned by the engine: started by start(), cancelled and awaited by shutdown()."""
        while True:
            await asyncio.sleep(interval_s)
            if self._llm is None:
                continue
            try:
                await self._llm.do_log_stats()
            except Exception as exc:  # a stats line is not worth the worker
                log.warning("vllm_log_stats_failed", error=f"{type(exc).__name__}: {exc}")

    async def shutdown(self) -> None:
        """Shut vLLM down; streams still pending end with EngineDead. Safe if never started."""
        if self._dead is None:
            self._dead = "the engine was shut down"
        await cancel_task(self._log_task)
        self._log_task = None
        llm, self._llm = self._llm, None
        if llm is not None:
            if self._streams:
                # Their streams get vLLM's "abort" ending, which _dead turns into EngineDead.
                await llm.abort(list(self._streams))
            llm.shutdown()
        await asyncio.to_thread(self._executor.shutdown, True)

    async def check_health(self) -> None:
        """Raise EngineDead if vLLM's engine core or output handler died, or the engine is not running."""
        llm, _ = self._started()
        try:
            await llm.check_health()
        except Exception as exc:
            raise EngineDead(f"vLLM is dead: {type(exc).__name__}: {exc}") from exc

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._snapshot.stats(), steps=self._outputs)

    # --- requests (adapter.LibraryEngine's hooks)

    def _new_stream(self) -> _Stream:
        return _Stream()

    def _invalid(self, exc: BaseException, input_field: str, constraint: ResponseConstraint | None) -> InvalidRequest:
        message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        return constraint_error(message, constraint) or invalid_from_vllm(
            message, getattr(exc, "parameter", None), input_field
        )

    def _library_params(self, request: GenerationRequest, api: Any, input_field: str) -> Any:
        constraint = library_constraint(request, self.library)
        try:
            kwargs = sampling_kwargs(request.sampling, self._vocab_size)
            if constraint is not None:
                kwargs["structured_outputs"] = api.StructuredOutputsParams(**vllm_structured(constraint))
            return api.SamplingParams(**kwargs, output_kind=api.DELTA)
        except (TypeError, ValueError) as exc:
            raise self._invalid(exc, input_field, constraint) from exc

    def _check_length(self, n_tokens: int, input_field: str) -> None:
        check_prompt_len(n_tokens, self._max_model_len, input_field)

    async def _deltas(
        self, llm: Any, api: Any, request: GenerationRequest, ids: list[int], params: Any, state: Any,
        input_field: str, tokenize_ms: float,
    ) -> AsyncIterator[TokenDelta]:  # fmt: skip
        n_logprobs = request.sampling.logprobs
        priority = engine_priority(request, self._policy)
        lora: dict[str, Any] = {}
        path = self._adapter_path(request)
        if path is not None:
            lora["lora_request"] = api.LoRARequest(request.adapter, lora_id(request.adapter), path)
        outputs = llm.generate(api.tokens_input(ids), params, request.request_id, priority=priority, **lora)
        try:
            while not state.aborted:
                try:
                    output = await outputs.__anext__()
                except StopAsyncIteration:
                    return
                except api.EngineDeadError as exc:
                    raise EngineDead(f"vLLM died: {exc}") from exc
                except ValueError as exc:
                    raise self._invalid(exc, input_field, request.sampling.constraint) from exc
                except api.EngineGenerateError as exc:
                    cause = exc.__cause__ or exc
                    if llm.errored:
                        raise EngineDead(f"vLLM died: {type(cause).__name__}: {cause}") from exc
                    raise InternalError(f"vLLM failed the request: {type(cause).__name__}: {cause}") from exc
                self._outputs += 1
                deltas = deltas_of(output, n_logprobs)
                if not output.finished:  # (with n > 1, samples that ended while others go on)
                    for delta in deltas:
                        yield delta
                    continue
                # let generate() end by itself (closing it would abort)
                async for _ in outputs:
                    pass
                if not deltas:
                    deltas = [TokenDelta()]
                for delta in deltas[:-1]:
                    yield delta
                yield dataclasses.replace(deltas[-1], engine_timings_ms=engine_timings(output, tokenize_ms))
                return
        finally:
            # Closing generate() before it finished aborts the request in vLLM (its GeneratorExit
            # handler): abort() came before vLLM knew the request, or the consumer went away.
            await outputs.aclose()

    def _abort_in_library(self, request_id: str, state: Any) -> Awaitable[None] | None:
        return self._llm.abort(request_id) if self._llm is not None else None

