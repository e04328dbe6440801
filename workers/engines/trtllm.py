"""The TensorRT-LLM engine (:class:`TrtllmEngine`): its LLM API (PyTorch backend by default) in this
process, streaming. WRITTEN FROM TensorRT-LLM'S DOCUMENTATION AND SOURCE ONLY: this adapter has NEVER
run against real TensorRT-LLM. Each function that calls TensorRT-LLM names the source file or page it
was read from (repository NVIDIA/TensorRT-LLM unless a URL is given), and says where the sources were
ambiguous; the unit tests drive it against a fake ``tensorrt_llm`` built from the same reading
(tests/unit/test_trtllm_mapping.py). The mappings are pure functions in the sibling trtllm_*.py
modules; ``tensorrt_llm`` is imported only by trtllm_args.Api, when the engine starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog

from llamamesh.errors import EngineDead, InternalError, InvalidRequest
from llamamesh.settings import TrtllmSettings, WorkerSettings
from llamamesh.types import GenerationRequest, ResponseConstraint, TokenDelta
from workers.engines.adapter import LibraryEngine, cancel_task, lora_id
from workers.engines.base import EngineStats
from workers.engines.constraints import check_grammar, library_constraint
from workers.engines.detokenizer import StopStrings
from workers.engines.prompts import use_chat_template
from workers.engines.trtllm_args import Api, kv_cache_kwargs, llm_kwargs, lora_kwargs, setting_of
from workers.engines.trtllm_outputs import Sent, delta_of
from workers.engines.trtllm_requests import check_prompt_tokens, invalid_from_trtllm, sampling_kwargs
from workers.engines.trtllm_stats import STATS_INTERVAL_S, IterationStats

log = structlog.get_logger(__name__)


@dataclasses.dataclass
class _Stream:
    aborted: bool = False
    result: Any = None  # the RequestOutput, once submitted
    abort_sent: bool = False


def _prompt_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside TensorRT-LLM's TransformersTokenizer (``LLM.tokenizer``,
    wrapping it as ``.tokenizer``: llm.py, tensorrt_llm/llmapi/tokenizer.py), which does not forward
    ``chat_template``; prompts are rendered with the wrapped one (``chat_template``,
    ``apply_chat_template``, ``encode``). A tokenizer without one is used as it is."""
    inner = getattr(tokenizer, "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "encode") else tokenizer


class TrtllmEngine(LibraryEngine):
    """Serves one model with TensorRT-LLM's LLM API. Attributes tests can assert: ``aborted`` (request
    ids aborted, by :meth:`abort` or by a consumer that went away). ``tokenize``, ``stream`` and
    ``abort`` are adapter.LibraryEngine's, around ``LLM.generate_async(streaming=True)`` (cumulative
    outputs). Unlike vLLM's generate(), it does not abort a request whose consumer went away by
    itself: :meth:`_left` does. ``request.priority`` is not passed: no per-request priority was found
    in the LLM API."""

    library = "TensorRT-LLM"

    def __init__(
        self,
        settings: WorkerSettings,
        trtllm: TrtllmSettings,
        device_count: int | None = None,
        stats_interval_s: float = STATS_INTERVAL_S,
        *,
        constraints: Callable[[ResponseConstraint], dict[str, Any]],
    ) -> None:
        """``constraints``: a response_format as ``GuidedDecodingParams`` keyword arguments (the
        registry's compiler for TensorRT-LLM)."""
        super().__init__(settings)
        self._trtllm_settings = trtllm
        self._device_count = device_count
        self._constraints = constraints
        self._figures = IterationStats(stats_interval_s)
        self._stats_task: asyncio.Task[None] | None = None
        # TensorRT-LLM has no stats before the first request, and says so on stdout at every poll.
        self._submitted = False
        self._lora_request_type: Any = None  # the LoRARequest class, once started with LoRA on

    # --- LoRA adapters (LoraConfig at start, a LoRARequest per request; never run on real TensorRT-LLM:
    # https://nvidia.github.io/TensorRT-LLM/features/lora.html, the PyTorch backend). TensorRT-LLM loads
    # an adapter from its folder at its first request, and keeps it in its LoRA cache (max_loras on the
    # GPU, max_cpu_loras in memory); the LLM API has no call to load or drop one.

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve adapter ``name`` from the PEFT folder ``path`` (loaded at its first request);
        InvalidRequest if LoRA is off or ``path`` holds no adapter_config.json."""
        self._started()
        if self._lora_request_type is None:
            raise InvalidRequest.field("adapter", "LoRA is off on this worker (LLAMAMESH_TRTLLM_ENABLE_LORA)")
        if not await asyncio.to_thread(os.path.isfile, os.path.join(path, "adapter_config.json")):
            raise InvalidRequest.field("adapter", f"no PEFT adapter folder (adapter_config.json) at {path!r}")
        self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        """Stop routing requests to ``name``; requests already running keep it, and TensorRT-LLM's LoRA
        cache evicts it when it needs the room."""
        self._adapters.pop(name, None)

    # --- lifecycle

    async def start(self) -> None:
        """Import tensorrt_llm and build the LLM (loads the model, blocking the loop meanwhile).

        A bad setting raises InvalidRequest naming it (``trtllm.<field>``); a missing tensorrt_llm or any
        other failure to load raises EngineDead. The LLM is built on the event loop thread, as vllm.py
        does (building it in a worker thread was not verified: TensorRT-LLM spawns MPI workers and
        registers atexit / signal handlers); the worker does not lease before it is loaded."""
        if self._llm is not None:
            return
        self._starting = "starting TensorRT-LLM (weights, KV cache)"
        try:
            await self._start()
        finally:
            self._starting = ""

    @property
    def starting(self) -> str:
        return self._starting

    async def _start(self) -> None:
        settings = self._trtllm_settings
        api = Api(settings.backend)
        device_count = self._device_count
        if device_count is None and not settings.tensor_parallel_size and settings.backend == "pytorch":
            import torch  # torch.cuda.device_count(): the default tensor parallel size

            device_count = torch.cuda.device_count()
        kwargs = llm_kwargs(self._settings, settings, device_count or 0)
        kv = kv_cache_kwargs(settings)
        lora = lora_kwargs(self._settings, settings)
        keys = [*kwargs, *kv, *(lora or ())]
        try:
            if kv:
                kwargs["kv_cache_config"] = api.KvCacheConfig(**kv)
            if lora is not None:
                lora_config, self._lora_request_type = api.lora()
                kwargs["lora_config"] = lora_config(**lora)
                # With one lora_dir and no tokenizer, TensorRT-LLM loads the adapter's tokenizer first
                # (llm.py ``_try_load_tokenizer``): prompts are the model's.
                kwargs.setdefault("tokenizer", self._settings.model_path)
            llm = api.LLM(**kwargs)
            tokenizer = llm.tokenizer
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise InvalidRequest.field(setting_of(str(exc), keys), str(exc)) from exc
        except Exception as exc:
            self._dead = f"cannot start TensorRT-LLM with {self._settings.model_path}: {type(exc).__name__}: {exc}"
            raise EngineDead(self._dead) from exc
        if tokenizer is None:
            await asyncio.to_thread(llm.shutdown)
            self._dead = "TensorRT-LLM loaded no tokenizer; set LLAMAMESH_TRTLLM_TOKENIZER"
            raise EngineDead(self._dead)
        self._llm, self._api = llm, api
        self._tokenizer = use_chat_template(_prompt_tokenizer(tokenizer), self._settings.chat_template)
        self._stats_task = asyncio.create_task(self._poll_stats(), name="trtllm-stats")
        log.info(
            "trtllm_started",
            model=self._settings.model_path,
            backend=settings.backend,
            tensor_parallel_size=kwargs.get("tensor_parallel_size"),
        )

    async def _poll_stats(self) -> None:
        """Owned by the engine: started by start(), cancelled and awaited by shutdown(). An idle engine
        yields no stats, so a poll with no entry and no request of ours in flight reads as idle."""
        figures = self._figures
        while (llm := self._llm) is not None:
            seen = await figures.drain(llm) if self._submitted else 0
            if not seen and not self._streams:
                figures.idle()
            await asyncio.sleep(figures.interval_s)

    async def shutdown(self) -> None:
        """Abort what runs and shut TensorRT-LLM down (``LLM.shutdown()``, llm.py, off the loop);
        streams still pending end with EngineDead. Safe if never started."""
        if self._dead is None:
            self._dead = "the engine was shut down"
        await cancel_task(self._stats_task)
        self._stats_task = None
        llm, self._llm = self._llm, None
        if llm is not None:
            for state in self._streams.values():
                # Their streams get TensorRT-LLM's 'cancelled' ending, which _dead turns into EngineDead.
                self._abort_result(state)
            await asyncio.to_thread(llm.shutdown)
        await asyncio.to_thread(self._executor.shutdown, True)

    async def check_health(self) -> None:
        """Raise EngineDead if the engine is not running, a stream saw it die, or TensorRT-LLM's own
        health check says so: ``LLM._check_health()``, private, in newer releases only (behind
        trtllm-serve's ``/health``: tensorrt_llm/serve/openai_server.py), used only when it exists."""
        llm, _ = self._started()
        check = getattr(llm, "_check_health", None)
        if not callable(check):
            return
        try:
            healthy = bool(check())
        except Exception as exc:
            raise EngineDead(f"TensorRT-LLM health check failed: {type(exc).__name__}: {exc}") from exc
        if not healthy:
            self._dead = "TensorRT-LLM reports its executor is not healthy"
            raise EngineDead(self._dead)

    def stats(self) -> EngineStats:
        f = self._figures
        return EngineStats(running=f.running, waiting=f.waiting, kv_cache_usage=f.kv_cache_usage, steps=self._outputs)

    # --- requests

    def _abort_result(self, state: _Stream) -> None:
        """``RequestOutput.abort()`` (tensorrt_llm/executor/result.py), once, while it runs."""
        result = state.result
        if result is None or state.abort_sent or result.finished:
            return
        state.abort_sent = True
        try:
            result.abort()
        except Exception as exc:  # the executor may be gone already; its streams fail on their own
            log.warning("trtllm_abort_failed", error=f"{type(exc).__name__}: {exc}")

    def _submit(
        self, llm: Any, api: Api, ids: list[int], params: Any, input_field: str, request: GenerationRequest
    ) -> Any:
        """``LLM.generate_async(inputs, sampling_params=, streaming=True)``: a plain (not async) method
        that submits and returns a ``RequestOutput``; ``inputs`` a ``TokensPrompt``, i.e. a dict with
        ``prompt_token_ids`` (tensorrt_llm/inputs/data.py); with an adapter, ``lora_request=`` a
        ``LoRARequest(name, int_id, path)``. It raises ValueError from its argument checks
        (InvalidRequest here) and RuntimeError("LLM is shutting down") once shut down (EngineDead
        here) (llm.py). Usage as in
        https://nvidia.github.io/TensorRT-LLM/examples/llm_inference_async_streaming.html."""
        constraint = request.sampling.constraint
        extra: dict[str, Any] = {}
        if request.cache_salt:  # the tenant's prefix cache (LLM.generate_async's cache_salt)
            extra["cache_salt"] = request.cache_salt
        path = self._adapter_path(request)
        if path is not None:
            try:  # LoRARequest checks that the folder is there (tensorrt_llm/executor/request.py)
                extra["lora_request"] = self._lora_request_type(request.adapter, lora_id(request.adapter), path)
            except ValueError as exc:
                raise InvalidRequest.field("adapter", f"adapter {request.adapter!r}: {exc}") from exc
        self._submitted = True
        try:
            return llm.generate_async({"prompt_token_ids": ids}, sampling_params=params, streaming=True, **extra)
        except (TypeError, ValueError) as exc:
            raise invalid_from_trtllm(str(exc), input_field, constraint) from exc
        except api.RequestError as exc:
            raise InternalError(f"TensorRT-LLM refused the request: {exc}") from exc
        except RuntimeError as exc:  # "LLM is shutting down"
            self._dead = f"TensorRT-LLM is not running: {exc}"
            raise EngineDead(self._dead) from exc

    # --- requests (adapter.LibraryEngine's hooks)

    def _new_stream(self) -> _Stream:
        return _Stream()

    def _library_params(self, request: GenerationRequest, api: Any, input_field: str) -> Any:
        """``SamplingParams`` (trtllm_requests.sampling_kwargs), with ``guided_decoding`` a
        ``GuidedDecodingParams`` for a response_format (the LLM API's guided decoding example; never
        run here). Its ValueError (``_validate``) is InvalidRequest naming our field."""
        constraint = library_constraint(request, self.library)
        try:
            kwargs = sampling_kwargs(request.sampling)
            if constraint is not None:
                # TensorRT-LLM compiles it in its executor loop, where a failure is no bad request: parse it first.
                check_grammar(constraint)
                kwargs["guided_decoding"] = api.GuidedDecodingParams(**self._constraints(constraint))
            return api.SamplingParams(**kwargs)
        except (TypeError, ValueError) as exc:
            raise invalid_from_trtllm(str(exc), input_field, constraint) from exc

    def _check_length(self, n_tokens: int, input_field: str) -> None:
        check_prompt_tokens(n_tokens, self._trtllm_settings.max_seq_len, input_field)

    def _prompt_limit(self) -> int:
        return self._trtllm_settings.max_seq_len

    async def _deltas(
        self,
        llm: Any,
        api: Any,
        request: GenerationRequest,
        ids: list[int],
        params: Any,
        state: Any,
        input_field: str,
        tokenize_ms: float,
    ) -> AsyncIterator[TokenDelta]:
        """The request's deltas. ``async for`` over a ``RequestOutput`` / ``GenerationResult``
        (tensorrt_llm/executor/result.py) yields the result itself after each response, CUMULATIVE
        (``outputs[0]`` is a ``CompletionOutput`` whose ``.text`` / ``.token_ids`` / ``.logprobs``
        grow; trtllm_outputs.delta_of cuts them), with ``.finished``. Errors while iterating:
        ``RequestError`` (a RuntimeError) fails one request (InternalError here); any other comes from
        a background thread or process, and TensorRT-LLM shuts the LLM down before raising it
        (tensorrt_llm/executor/executor.py ``_handle_background_error``, executor/utils.py):
        EngineDead here."""
        # TensorRT-LLM's outputs hold only what it generates (SamplingParams.exclude_input_from_output
        # defaults to True); its detokenizer starts at the output, without resumed tokens as context.
        state.result = self._submit(llm, api, ids, params, input_field, request)
        stops = request.sampling.stop
        sent = Sent(stops=StopStrings(stops) if stops else None, min_tokens=request.sampling.min_tokens or 0)
        while True:
            try:
                output = await state.result.__anext__()
            except StopAsyncIteration:
                return
            except api.RequestError as exc:
                raise InternalError(f"TensorRT-LLM failed the request: {exc}") from exc
            except Exception as exc:  # a background error: TensorRT-LLM has shut itself down
                self._dead = f"TensorRT-LLM died: {type(exc).__name__}: {exc}"
                raise EngineDead(self._dead) from exc
            self._outputs += 1
            delta = delta_of(output, sent, request.sampling.logprobs)
            if delta.finish_reason is None and output.finished:
                raise InternalError("TensorRT-LLM finished the request without a finish_reason")
            if delta.finish_reason is not None and not output.finished:
                self._abort_result(state)  # a stop string found in the text (trtllm_outputs.delta_of)
            yield delta
            if delta.finish_reason is not None:
                return

    def _abort_in_library(self, request_id: str, state: Any) -> Awaitable[None] | None:
        self._abort_result(state)
        return None

    def _left(self, state: Any) -> None:
        if self._dead is None:  # TensorRT-LLM would go on generating for no one
            self._abort_result(state)
