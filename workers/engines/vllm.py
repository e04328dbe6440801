"""The GPU engine (:class:`VllmEngine`): vLLM 0.26's ``AsyncLLM`` in this process, streaming DELTA
outputs. It is the thin layer that builds vLLM objects from the pure mappings of its sibling modules
(vllm_args.py: the engine arguments; vllm_requests.py: sampling parameters, priority and errors;
vllm_outputs.py: outputs as deltas; vllm_stats.py: the scheduler figures), on the stream skeleton it
shares with TensorRT-LLM's (adapter.LibraryEngine). ``vllm`` is imported only when the engine starts
(this module itself only when the registry builds the engine); each part names the vLLM 0.26.0 APIs
it uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog

from llamamesh.errors import EngineDead, InternalError, InvalidRequest
from llamamesh.settings import VllmSettings, WorkerSettings
from llamamesh.types import GenerationRequest, ResponseConstraint, TokenDelta
from workers.engines.adapter import LibraryEngine, cancel_task, lora_id
from workers.engines.base import EngineStats
from workers.engines.constraints import constraint_error, library_constraint
from workers.engines.prompts import use_chat_template
from workers.engines.vllm_args import CoreClient, engine_config
from workers.engines.vllm_outputs import deltas_of, engine_timings
from workers.engines.vllm_requests import check_prompt_len, engine_priority, invalid_from_vllm, sampling_kwargs
from workers.engines.vllm_stats import SchedulerSnapshot, stat_logger_factory

log = structlog.get_logger(__name__)


@dataclasses.dataclass
class _Stream:
    aborted: bool = False


class _Vllm:
    """The vLLM names the engine uses, imported once by :meth:`VllmEngine.start`:
    ``vllm.inputs.tokens_input`` (an already-tokenized prompt; vLLM does no tokenization of its own),
    ``vllm.lora.request.LoRARequest``, ``vllm.sampling_params.SamplingParams``,
    ``StructuredOutputsParams`` (a response_format) and ``RequestOutputKind.DELTA``,
    ``vllm.v1.engine.exceptions.EngineDeadError`` and ``EngineGenerateError``,
    ``vllm.envs.VLLM_LOG_STATS_INTERVAL``."""

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
        *,
        constraints: Callable[[ResponseConstraint], dict[str, Any]],
        core: CoreClient | None = None,
    ) -> None:
        """``constraints``: a response_format as ``StructuredOutputsParams`` keyword arguments (the
        registry's compiler for vLLM); ``core``: the engine core another process started, for one of
        its frontends."""
        super().__init__(settings)
        self._vllm_settings = vllm
        self._policy = vllm.scheduling_policy
        self._device_count = device_count
        self._constraints = constraints
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

    # --- LoRA adapters (vLLM's LoRARequest; tested on a GPU with vLLM 0.26: tests/e2e/test_node.py).
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

    async def start(self) -> None:
        """Build vLLM's config and engine (loads the model, blocking the loop meanwhile, as ``vllm serve``
        does: the worker does not lease before that; with a ``core`` it connects to an engine core
        another process started). Reads ``model_config.max_model_len``,
        ``model_config.get_vocab_size()`` and ``vllm_config.scheduler_config.max_num_seqs``.

        A bad engine argument raises InvalidRequest naming the setting (``vllm.<field>``); any other
        failure to load raises EngineDead."""
        if self._llm is not None:
            return
        self._starting = "configuring vLLM"
        try:
            api = _Vllm()
            engine_args, config = engine_config(self._settings, self._vllm_settings, self._device_count, self._core)
            if not self._vllm_settings.max_num_seqs:  # else __init__ warned already
                self._warn_if_underfed(config.scheduler_config.max_num_seqs)
            self._starting = "starting vLLM (weights, memory profile, CUDA graphs)"
            llm, tokenizer = self._build(engine_args, config)
        except EngineDead as exc:
            self._dead = exc.message
            raise
        finally:
            self._starting = ""
        self._llm, self._api, self._tokenizer = llm, api, tokenizer
        self._max_model_len = int(llm.model_config.max_model_len)
        self._vocab_size = int(llm.model_config.get_vocab_size())
        if not engine_args.disable_log_stats:
            # vLLM's periodic throughput line, as `vllm serve` prints it.
            self._log_task = asyncio.create_task(self._log_stats(api.log_stats_interval_s), name="vllm-log-stats")
        log.info(
            "vllm_started",
            model=self._settings.model_path,
            max_model_len=self._max_model_len,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        )

    def _build(self, engine_args: Any, config: Any) -> tuple[Any, Any]:
        """vLLM's AsyncLLM for ``config`` and its tokenizer; EngineDead if it cannot start.
        ``vllm.v1.engine.async_llm.AsyncLLM.from_vllm_config(stat_loggers=...)`` with
        ``vllm.usage.usage_lib.UsageContext.OPENAI_API_SERVER`` (the scheduler defaults of ``vllm
        serve``); the tokenizer ``get_tokenizer`` returns is used through its Hugging Face surface
        (``chat_template``, ``apply_chat_template``, ``encode``)."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        core = self._core
        try:
            llm = AsyncLLM.from_vllm_config(
                config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=[stat_logger_factory(self._snapshot)],
                enable_log_requests=engine_args.enable_log_requests,
                disable_log_stats=engine_args.disable_log_stats,
                client_addresses=dict(core.addresses) if core is not None else None,
                client_count=core.count if core is not None else 1,
                client_index=core.index if core is not None else 0,
            )
            tokenizer = use_chat_template(llm.get_tokenizer(), self._settings.chat_template)
        except Exception as exc:
            why = f"cannot start vLLM with {self._settings.model_path}: {type(exc).__name__}: {exc}"
            raise EngineDead(why) from exc
        return llm, tokenizer

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
        """vLLM's ``ValueError`` (and its subclass ``vllm.exceptions.VLLMValidationError``, read
        through its ``parameter`` attribute) as ours, naming our field."""
        message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        return constraint_error(message, constraint) or invalid_from_vllm(
            message, getattr(exc, "parameter", None), input_field
        )

    def _library_params(self, request: GenerationRequest, api: Any, input_field: str) -> Any:
        constraint = library_constraint(request, self.library)
        try:
            kwargs = sampling_kwargs(request.sampling, self._vocab_size)
            if constraint is not None:
                kwargs["structured_outputs"] = api.StructuredOutputsParams(**self._constraints(constraint))
            return api.SamplingParams(**kwargs, output_kind=api.DELTA)
        except (TypeError, ValueError) as exc:
            raise self._invalid(exc, input_field, constraint) from exc

    def _check_length(self, n_tokens: int, input_field: str) -> None:
        check_prompt_len(n_tokens, self._max_model_len, input_field)

    def _prompt_limit(self) -> int:
        return self._max_model_len

    def _held_back(self, request: GenerationRequest) -> int:
        """vLLM streams a request's text its longest stop string's length less one character behind its
        tokens (``stop_buffer_length`` in vllm/v1/engine/detokenizer.py; we never set
        ``include_stop_str_in_output``)."""
        return max((len(s) for s in request.sampling.stop), default=1) - 1

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
        """The request's deltas from ``AsyncLLM.generate`` (one DELTA output per step). vLLM's
        ``EngineDeadError`` (or an ``EngineGenerateError`` once ``llm.errored``) is EngineDead, any
        other ``EngineGenerateError`` InternalError, a ``ValueError`` InvalidRequest."""
        n_logprobs = request.sampling.logprobs
        priority = engine_priority(request, self._policy)
        lora: dict[str, Any] = {}
        path = self._adapter_path(request)
        if path is not None:
            lora["lora_request"] = api.LoRARequest(request.adapter, lora_id(request.adapter), path)
        # The tenant's prefix cache: vLLM's cache_salt keeps its cached blocks apart from others'.
        prompt = api.tokens_input(ids, cache_salt=request.cache_salt) if request.cache_salt else api.tokens_input(ids)
        outputs = llm.generate(prompt, params, request.request_id, priority=priority, **lora)
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
