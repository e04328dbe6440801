"""The trtllm engine without TensorRT-LLM: the pure mappings (settings -> LLM kwargs, SamplingParams ->
TensorRT-LLM kwargs, cumulative outputs -> TokenDelta, errors and iteration stats -> ours), and the
adapter's start/stream/abort/stats control flow driven by a fake ``tensorrt_llm`` module that follows
what the LLM API's source says it does (tensorrt_llm/llmapi/llm.py, tensorrt_llm/executor/result.py).
The fake is the only TensorRT-LLM these tests (or the adapter) have ever met."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import types
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest

from llamamesh.errors import EngineDead, InternalError, InvalidRequest, NotFound, PromptTooLong, Unavailable
from llamamesh.settings import Settings, TrtllmSettings, WorkerSettings
from llamamesh.types import (
    ChatMessage,
    ConstraintKind,
    FinishReason,
    GenerationRequest,
    JobKind,
    ResponseConstraint,
    SamplingParams,
    TokenDelta,
)
from tests.waiting import until
from workers.engines import registry
from workers.engines.adapter import lora_id
from workers.engines.base import EngineStats
from workers.engines.constraints import trtllm_guided
from workers.engines.detokenizer import StopStrings
from workers.engines.trtllm import TrtllmEngine
from workers.engines.trtllm_args import NOT_INSTALLED, kv_cache_kwargs, llm_kwargs, lora_kwargs, setting_of
from workers.engines.trtllm_outputs import Sent, delta_of
from workers.engines.trtllm_requests import invalid_from_trtllm, sampling_kwargs
from workers.engines.trtllm_stats import stat_figures

pytestmark = pytest.mark.timeout(10)

WORKER = WorkerSettings(model="llama-8b", model_path="/models/llama")


def field_of(exc: pytest.ExceptionInfo[InvalidRequest]) -> str:
    return exc.value.violations[0].field


# --- engine arguments


def test_minimal_llm_kwargs_pass_the_model_the_gpus_and_iteration_stats() -> None:
    assert llm_kwargs(WORKER, TrtllmSettings(), device_count=1) == {
        "model": "/models/llama",
        "tensor_parallel_size": 1,
        "enable_iter_perf_stats": True,
        "guided_decoding_backend": "xgrammar",
        "enable_chunked_prefill": True,  # else TensorRT-LLM refuses prompts over max_num_tokens
    }
    assert kv_cache_kwargs(TrtllmSettings()) == {}


@pytest.mark.parametrize(("setting", "devices", "expected"), [(0, 4, 4), (0, 0, 1), (2, 8, 2), (1, 4, 1)])
def test_tensor_parallel_size_defaults_to_every_visible_gpu(setting: int, devices: int, expected: int) -> None:
    kwargs = llm_kwargs(WORKER, TrtllmSettings(tensor_parallel_size=setting), device_count=devices)
    assert kwargs["tensor_parallel_size"] == expected


def test_an_engine_directory_keeps_its_own_parallelism_and_has_no_iteration_stats_flag() -> None:
    kwargs = llm_kwargs(WORKER, TrtllmSettings(backend="tensorrt"), device_count=8)
    assert kwargs == {"model": "/models/llama"}  # TrtLlmArgs has no enable_iter_perf_stats
    chunked = llm_kwargs(WORKER, TrtllmSettings(backend="tensorrt", enable_chunked_prefill=True), 1)
    assert chunked["enable_chunked_prefill"] is True  # only when asked: the engine must be built for it
    assert (
        llm_kwargs(WORKER, TrtllmSettings(backend="tensorrt", tensor_parallel_size=2), 8)["tensor_parallel_size"] == 2
    )


def test_every_setting_is_forwarded_verbatim() -> None:
    settings = TrtllmSettings(
        tokenizer="/tok",
        dtype="bfloat16",
        tensor_parallel_size=2,
        max_seq_len=8192,
        max_batch_size=256,
        max_num_tokens=16384,
        enable_chunked_prefill=False,
        free_gpu_memory_fraction=0.85,
        enable_block_reuse=False,
        trust_remote_code=True,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=8,
        lora_target_modules="attn_q",
    )
    assert llm_kwargs(WORKER, settings, device_count=8) == {
        "model": "/models/llama",
        "tokenizer": "/tok",
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "max_seq_len": 8192,
        "max_batch_size": 256,
        "max_num_tokens": 16384,
        "trust_remote_code": True,
        "enable_iter_perf_stats": True,
        "guided_decoding_backend": "xgrammar",
        "enable_chunked_prefill": False,
    }
    assert kv_cache_kwargs(settings) == {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": False}
    lora = lora_kwargs(WORKER, settings) or {}
    assert lora == {"max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": 8, "lora_target_modules": ["attn_q"]}
    # Every TrtllmSettings field lands somewhere (backend picks the LLM class, enable_lora turns LoraConfig on).
    names = {f.name for f in dataclasses.fields(TrtllmSettings)} - {"backend", "enable_lora"}
    assert names <= set(llm_kwargs(WORKER, settings, 8)) | set(kv_cache_kwargs(settings)) | set(lora)


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("TRUE", True), (" false ", False), ("", None)])
def test_enable_block_reuse_is_tri_state(raw: str, expected: bool | None) -> None:
    trtllm = Settings.from_env({"LLAMAMESH_TRTLLM_ENABLE_BLOCK_REUSE": raw}).trtllm
    assert kv_cache_kwargs(trtllm).get("enable_block_reuse") is expected


@pytest.mark.parametrize(
    ("worker", "settings", "field"),
    [
        (WorkerSettings(model_path=""), TrtllmSettings(), "worker.model_path"),
        (WORKER, TrtllmSettings(backend="onnx"), "trtllm.backend"),
    ],
)
def test_bad_settings_name_their_setting(worker: WorkerSettings, settings: TrtllmSettings, field: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        llm_kwargs(worker, settings, 1)
    assert field_of(exc) == field


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tensor_parallel_size", -1, "an integer, 0 or more"),
        ("max_num_tokens", -5, "an integer, 0 or more"),
        ("max_cpu_loras", -1, "an integer, 0 or more"),
        ("free_gpu_memory_fraction", 1.5, "a number, from 0 to 1"),
    ],
)
def test_out_of_range_settings_are_refused_naming_their_variable(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=f"LLAMAMESH_TRTLLM_{field.upper()}={value}: expected {expected}"):
        TrtllmSettings(**{field: value})  # type: ignore[arg-type]


def test_llm_argument_errors_are_pinned_to_a_setting() -> None:
    keys = ["model", "tensor_parallel_size", "max_num_tokens", "free_gpu_memory_fraction"]
    assert setting_of("LLM got invalid argument: max_num_tokens", keys) == "trtllm.max_num_tokens"
    assert setting_of("free_gpu_memory_fraction\n  Input should be <= 1", keys) == "trtllm.free_gpu_memory_fraction"
    assert setting_of("the model is broken", keys) == "worker.model_path"
    assert setting_of("something else", keys) == "trtllm"


# --- sampling


def test_unset_sampling_keeps_trtllms_defaults_except_ours() -> None:
    # TensorRT-LLM would decode greedily (nothing of temperature/top_p/top_k set) and stop at 32 tokens.
    assert sampling_kwargs(SamplingParams()) == {"max_tokens": 256, "temperature": 1.0}


def test_every_sampling_field_is_mapped() -> None:
    params = SamplingParams(
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        stop=("###", "\n\n"),
        stop_token_ids=(2, 7),
        seed=0,
        ignore_eos=False,
        min_tokens=3,
        logprobs=5,
    )
    kwargs = sampling_kwargs(params)
    assert kwargs == {
        "max_tokens": 12,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "stop_token_ids": [2, 7],
        "seed": 0,
        "ignore_eos": False,
        "min_tokens": 3,
        "logprobs": 5,
    }
    # TensorRT-LLM would end at a stop string before min_tokens: with min_tokens the engine matches them itself.
    assert sampling_kwargs(dataclasses.replace(params, min_tokens=0))["stop"] == ["###", "\n\n"]
    # Same names on both sides (TensorRT-LLM's SamplingParams calls the seed `seed`), none forgotten.
    # (constraint: stream() adds it as the library's own parameter object; tests/unit/test_constraints.py;
    # n: workers/samples.py runs each sample as its own request on this adapter)
    assert set(kwargs) | {"constraint", "n", "stop"} == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_off_is_trtllms_zero(top_k: int, expected: int) -> None:
    assert sampling_kwargs(SamplingParams(top_k=top_k))["top_k"] == expected


def test_zero_logprobs_still_asks_trtllm_for_the_sampled_token() -> None:
    assert sampling_kwargs(SamplingParams(logprobs=0))["logprobs"] == 1  # TensorRT-LLM's 0 means none
    kwargs = sampling_kwargs(SamplingParams(temperature=0.0, min_tokens=0, presence_penalty=0.0))
    assert kwargs["temperature"] == 0.0 and kwargs["min_tokens"] == 0 and kwargs["presence_penalty"] == 0.0


@pytest.mark.parametrize(
    ("message", "field", "too_long"),
    [
        ("require 0 <= top_p <= 1, got top_p=1.5", "top_p", False),
        ("require top_k >= 0, got top_k=-3", "top_k", False),
        ("require temperature >= 0, got temperature=-1.0", "temperature", False),
        ("SamplingParams.__init__() got an unexpected keyword argument 'min_p'", "min_p", False),
        (
            "`sampling_params.logprobs=5` requires `gather_generation_logits=True` to be passed explicitly",
            "logprobs",
            False,
        ),
        (
            "The sum of prompt length (9000.0), query length (0) should not exceed max_num_tokens (8192)",
            "messages",
            True,
        ),
        ("SamplingParams.n (4) should not exceed max_batch_size (2)", "n", False),
    ],
)
def test_trtllm_argument_errors_name_our_field(message: str, field: str, too_long: bool) -> None:
    err = invalid_from_trtllm(message, "messages")
    assert err.violations[0].field == field
    assert isinstance(err, PromptTooLong) is too_long
    assert err.violations[0].description == message


# --- outputs


class Lp(NamedTuple):
    """tensorrt_llm.executor.result.Logprob's fields."""

    logprob: float
    rank: int | None = None


@dataclasses.dataclass
class Completion:
    """tensorrt_llm.executor.result.CompletionOutput's fields the adapter reads."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    index: int = 0


def test_cumulative_outputs_become_deltas_without_repeats() -> None:
    sent = Sent()
    out = SimpleNamespace(outputs=[Completion(" a", [5])], finished=False)
    assert delta_of(out, sent, None) == TokenDelta(text=" a", token_ids=(5,))
    out.outputs[0] = Completion(" a b", [5, 6])
    assert delta_of(out, sent, None) == TokenDelta(text=" b", token_ids=(6,))
    out.outputs[0] = Completion(" a b", [5, 6])  # a response that added nothing
    assert delta_of(out, sent, None) == TokenDelta()
    # The stop string: TensorRT-LLM cuts the text at it and trims the stop-word tokens; nothing repeats.
    out.outputs[0] = Completion(" a b", [5, 6], finish_reason="stop", stop_reason="###")
    assert delta_of(out, sent, None) == TokenDelta(finish_reason=FinishReason.STOP_SEQUENCE)
    assert delta_of(SimpleNamespace(outputs=[]), Sent(), None) == TokenDelta()


def test_the_start_of_a_stop_string_is_held_back_and_never_sent() -> None:
    """TensorRT-LLM streams " E" of the stop string " END" before its token check sees the stop,
    then trims only the token ids: the caller's text has neither the stop string nor its start, and
    text held back that no stop string followed comes out at the end."""

    def deltas(*outputs: Completion) -> list[TokenDelta]:
        sent = Sent(stops=StopStrings((" END",)))
        return [delta_of(SimpleNamespace(outputs=[c]), sent, None) for c in outputs]

    got = deltas(
        Completion(" Hi", [10]),
        Completion(" Hi E", [10, 11]),
        Completion(" Hi E", [10], finish_reason="stop", stop_reason=" END"),
    )
    assert "".join(d.text for d in got) == " Hi" and got[-1].finish_reason is FinishReason.STOP_SEQUENCE
    # spelled by other tokens than the stop word's: found in the text, the request ends here
    (ended,) = deltas(Completion(" Hi ENDless", [10, 12, 13]))
    assert (ended.text, ended.finish_reason) == (" Hi", FinishReason.STOP_SEQUENCE)
    # a held " E" that turned out " Eh" is sent on; what is held at the end of the output too
    got = deltas(
        Completion(" E", [11]), Completion(" Eh", [11, 14]), Completion(" Eh E", [11, 14, 11], finish_reason="length")
    )
    assert [d.text for d in got] == ["", " Eh", " E"] and got[-1].finish_reason is FinishReason.LENGTH


def test_logprobs_come_with_the_delta_they_belong_to() -> None:
    """The mapping itself: tests/unit/test_adapter_mapping.py."""
    positions = [{5: Lp(-0.1, 1), 6: Lp(-2.0, 2)}, {9: Lp(-0.3, 2), 8: Lp(-0.2, 1)}]
    sent = Sent()
    out = SimpleNamespace(outputs=[Completion(" a b", [5, 9], positions)])
    assert [lp.token_id for lp in delta_of(out, sent, 1).logprobs] == [5, 9]


def test_iteration_stats_give_running_waiting_and_kv_usage() -> None:
    stat = {"numActiveRequests": 3, "numQueuedRequests": 2, "kvCacheStats": {"usedNumBlocks": 25, "maxNumBlocks": 100}}
    assert stat_figures(stat) == (3, 2, 0.25)
    assert stat_figures(json.dumps(stat)) == (3, 2, 0.25)
    assert stat_figures({"numActiveRequests": 1, "kvCacheStats": {"usedNumBlocks": 1, "freeNumBlocks": 3}}) == (
        1,
        0,
        0.25,
    )
    assert stat_figures({"numActiveRequests": 0}) == (0, 0, 0.0)
    assert stat_figures({"iter": 4}) is None


# --- a fake tensorrt_llm, from its source


class FakeRequestError(RuntimeError):
    """tensorrt_llm.executor.utils.RequestError."""


class FakeSamplingParams:
    """tensorrt_llm.sampling_params.SamplingParams: keyword-only fields, _validate() on construction."""

    unsupported: frozenset[str] = frozenset()

    def __init__(self, **kwargs: Any) -> None:
        for key in kwargs:
            if key in self.unsupported:
                raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument '{key}'")
        top_p = kwargs.get("top_p")
        if top_p is not None and not 0 <= top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={top_p}")
        self.kwargs = kwargs


class FakeKvCacheConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class FakeGuidedDecodingParams:
    """The documented fields: one of json, json_object, regex, grammar (structural_tag not used)."""

    def __init__(self, json: Any = None, regex: Any = None, grammar: Any = None, json_object: bool = False) -> None:
        self.kwargs = {
            k: v for k, v in {"json": json, "regex": regex, "grammar": grammar, "json_object": json_object}.items() if v
        }


class HfTokenizer:
    """The Hugging Face surface: one id per word, BOS=1 with special tokens."""

    chat_template = "{{ messages }}"

    def __init__(self, entered: threading.Event | None = None, release: threading.Event | None = None) -> None:
        self.entered, self.release = entered, release

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.entered is not None and self.release is not None:
            self.entered.set()
            self.release.wait(5)
        return ([1] if add_special_tokens else []) + [100 + len(w) for w in text.split()]

    def apply_chat_template(
        self, chat: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool, chat_template: str = ""
    ) -> str:
        return " ".join(f"<{m['role']}> {m['content']}" for m in chat) + " <assistant>"


class TransformersTokenizer:
    """tensorrt_llm.llmapi.tokenizer.TransformersTokenizer: wraps the HF tokenizer as .tokenizer and does
    not forward chat_template."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(text, *args, **kwargs)


class FakeResult:
    """GenerationResult's streaming surface (executor/result.py): iterating returns the result itself
    after each response, outputs[0] cumulative; abort() makes the executor answer with a final
    'cancelled' response; finished is true after the final one."""

    def __init__(self, prompt_token_ids: list[int], params: FakeSamplingParams) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self.outputs = [Completion()]
        self._done = False
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self.abort_calls = 0

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self.abort_calls += 1
        self._responses.put_nowait({"finish": "cancelled"})

    def respond(self, text: str = "", ids: tuple[int, ...] = (), **final: Any) -> None:
        self._responses.put_nowait({"text": text, "ids": ids, **final})

    def fail(self, exc: BaseException) -> None:
        self._responses.put_nowait(exc)

    def __aiter__(self) -> FakeResult:
        return self

    async def __anext__(self) -> FakeResult:
        if self._done:
            raise StopAsyncIteration
        response = await self._responses.get()
        if isinstance(response, BaseException):
            raise response
        out = self.outputs[0]
        out.text += response.get("text", "")
        out.token_ids.extend(response.get("ids", ()))
        out.logprobs.extend(response.get("logprobs", ()))
        if "finish" in response:
            out.finish_reason = response["finish"]
            out.stop_reason = response.get("stop_reason")
            self._done = True
        return self


class FakeLLM:
    """tensorrt_llm.llmapi.LLM (the PyTorch backend's), as the adapter uses it."""

    created: list[FakeLLM] = []
    fail_with: BaseException | None = None

    def __init__(self, model: str, **kwargs: Any) -> None:
        if FakeLLM.fail_with is not None:
            raise FakeLLM.fail_with
        self.kwargs = {"model": model, **kwargs}
        self.tokenizer = TransformersTokenizer(HfTokenizer())
        self.results: list[FakeResult] = []
        self.submit_error: BaseException | None = None
        self.pending_stats: list[Any] = []
        self.stats_timeouts: list[float] = []
        self.healthy = True
        self.shut_down = False
        FakeLLM.created.append(self)

    def generate_async(
        self,
        inputs: dict[str, Any],
        sampling_params: Any = None,
        streaming: bool = False,
        lora_request: Any = None,
        cache_salt: str | None = None,
    ) -> Any:
        assert streaming
        if self.submit_error is not None:
            raise self.submit_error
        result = FakeResult(inputs["prompt_token_ids"], sampling_params)
        result.lora_request = lora_request  # type: ignore[attr-defined]
        result.cache_salt = cache_salt  # type: ignore[attr-defined]
        self.results.append(result)
        return result

    def get_stats_async(self, timeout: float = 2) -> AsyncIterator[Any]:
        self.stats_timeouts.append(timeout)

        async def drain() -> AsyncIterator[Any]:
            while self.pending_stats:
                yield self.pending_stats.pop(0)

        return drain()

    def _check_health(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        self.shut_down = True


class FakeEngineLLM(FakeLLM):
    """tensorrt_llm._tensorrt_engine.LLM."""


class FakeLoraConfig:
    """tensorrt_llm.lora_manager.LoraConfig (the LoRA docs' fields)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class FakeLoRARequest(NamedTuple):
    """tensorrt_llm.executor.request.LoRARequest(lora_name, lora_int_id, lora_path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    pkg = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    engine_mod = types.ModuleType("tensorrt_llm._tensorrt_engine")
    llmapi.LLM = FakeLLM  # type: ignore[attr-defined]
    llmapi.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    llmapi.KvCacheConfig = FakeKvCacheConfig  # type: ignore[attr-defined]
    llmapi.GuidedDecodingParams = FakeGuidedDecodingParams  # type: ignore[attr-defined]
    llmapi.RequestError = FakeRequestError  # type: ignore[attr-defined]
    engine_mod.LLM = FakeEngineLLM  # type: ignore[attr-defined]
    lora_manager = types.ModuleType("tensorrt_llm.lora_manager")
    lora_manager.LoraConfig = FakeLoraConfig  # type: ignore[attr-defined]
    executor_request = types.ModuleType("tensorrt_llm.executor.request")
    executor_request.LoRARequest = FakeLoRARequest  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm.lora_manager", lora_manager)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.executor", types.ModuleType("tensorrt_llm.executor"))
    monkeypatch.setitem(sys.modules, "tensorrt_llm.executor.request", executor_request)
    pkg.llmapi = llmapi  # type: ignore[attr-defined]
    pkg._tensorrt_engine = engine_mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    monkeypatch.setitem(sys.modules, "tensorrt_llm._tensorrt_engine", engine_mod)
    FakeLLM.created = []
    FakeLLM.fail_with = None
    yield SimpleNamespace(created=FakeLLM.created)
    FakeSamplingParams.unsupported = frozenset()
    FakeLLM.fail_with = None


async def started(settings: TrtllmSettings | None = None, adapters: str = "") -> tuple[TrtllmEngine, FakeLLM]:
    engine = TrtllmEngine(
        WorkerSettings(model="llama-8b", model_path="/m", max_inflight=4, adapters=adapters),
        settings or TrtllmSettings(),
        device_count=1,
        stats_interval_s=0.01,
        constraints=trtllm_guided,
    )
    await engine.start()
    return engine, engine._llm


def request(**kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=kw.pop("request_id", "r1"), model="llama-8b", **kw)


async def collect(engine: TrtllmEngine, req: GenerationRequest, into: list[TokenDelta]) -> None:
    async for delta in engine.stream(req):
        into.append(delta)


async def anext_of(stream: AsyncIterator[TokenDelta]) -> TokenDelta:
    return await stream.__anext__()


# --- start


async def test_start_builds_the_llm_from_the_settings(trt: SimpleNamespace) -> None:
    engine, llm = await started(TrtllmSettings(max_num_tokens=4096, free_gpu_memory_fraction=0.8))
    kv = llm.kwargs.pop("kv_cache_config")
    assert isinstance(kv, FakeKvCacheConfig) and kv.kwargs == {"free_gpu_memory_fraction": 0.8}
    assert llm.kwargs == {
        "model": "/m",
        "tensor_parallel_size": 1,
        "max_num_tokens": 4096,
        "enable_iter_perf_stats": True,
        "guided_decoding_backend": "xgrammar",
        "enable_chunked_prefill": True,
    }
    assert type(llm) is FakeLLM
    # Prompts are rendered with the HF tokenizer inside TensorRT-LLM's wrapper (chat_template lives there).
    assert isinstance(engine._tokenizer, HfTokenizer)
    await engine.start()  # idempotent
    assert len(trt.created) == 1
    await engine.shutdown()
    assert llm.shut_down


async def test_an_engine_directory_uses_the_tensorrt_backend_llm(trt: SimpleNamespace) -> None:
    engine, llm = await started(TrtllmSettings(backend="tensorrt", tokenizer="/tok"))
    assert type(llm) is FakeEngineLLM and llm.kwargs == {"model": "/m", "tokenizer": "/tok"}
    await engine.shutdown()


async def test_a_missing_tensorrt_llm_is_a_dead_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import fails: ModuleNotFoundError
    engine = TrtllmEngine(WORKER, TrtllmSettings(), device_count=1, constraints=trtllm_guided)
    with pytest.raises(EngineDead) as exc:
        await engine.start()
    assert exc.value.message == NOT_INSTALLED and exc.value.message.startswith("tensorrt_llm is not installed")
    with pytest.raises(EngineDead):
        await engine.check_health()
    await engine.shutdown()


async def test_llm_construction_errors_become_ours(trt: SimpleNamespace) -> None:
    FakeLLM.fail_with = ValueError("LLM got invalid argument: max_num_tokens")
    with pytest.raises(InvalidRequest) as exc:
        await started(TrtllmSettings(max_num_tokens=4096))
    assert field_of(exc) == "trtllm.max_num_tokens"
    FakeLLM.fail_with = RuntimeError("CUDA out of memory")
    with pytest.raises(EngineDead):
        await started()


# --- LoRA (LoraConfig at start, a LoRARequest per request)


def test_lora_kwargs_come_from_the_workers_adapters_and_the_settings() -> None:
    assert lora_kwargs(WORKER, TrtllmSettings()) is None  # off
    one = dataclasses.replace(WORKER, adapters="sql=/a/sql")
    assert lora_kwargs(one, TrtllmSettings()) == {"lora_dir": ["/a/sql"]}  # TensorRT-LLM reads its modules
    own = dataclasses.replace(WORKER, adapters="sql=/a/sql,fr=/a/fr")
    assert lora_kwargs(own, TrtllmSettings(lora_target_modules="attn_q")) == {
        "lora_dir": ["/a/sql", "/a/fr"],
        "lora_target_modules": ["attn_q"],
    }
    # Of none or several adapters TensorRT-LLM cannot infer the modules (it asserts): refused at start.
    for worker, settings in ((own, TrtllmSettings()), (WORKER, TrtllmSettings(enable_lora=True))):
        with pytest.raises(InvalidRequest) as modules:
            lora_kwargs(worker, settings)
        assert field_of(modules) == "trtllm.lora_target_modules"
    s = TrtllmSettings(
        enable_lora=True, max_loras=2, max_cpu_loras=8, max_lora_rank=16, lora_target_modules="attn_q, attn_k,attn_v"
    )
    assert lora_kwargs(WORKER, s) == {
        "max_loras": 2,
        "max_cpu_loras": 8,
        "max_lora_rank": 16,
        "lora_target_modules": ["attn_q", "attn_k", "attn_v"],
    }
    with pytest.raises(InvalidRequest) as engines:
        lora_kwargs(own, TrtllmSettings(backend="tensorrt"))
    assert field_of(engines) == "trtllm.enable_lora"


async def test_adapters_go_with_their_lora_request_and_load_at_run_time(trt: SimpleNamespace, tmp_path: Any) -> None:
    engine, llm = await started(TrtllmSettings(max_loras=2), adapters="sql=/a/sql")
    config = llm.kwargs["lora_config"]
    assert isinstance(config, FakeLoraConfig) and config.kwargs == {"lora_dir": ["/a/sql"], "max_loras": 2}
    assert engine.adapters == ("sql",)
    assert llm.kwargs["tokenizer"] == "/m"  # the model's, not the one adapter's (TensorRT-LLM's first pick)
    task = asyncio.create_task(collect(engine, request(prompt="x", adapter="sql"), []))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    assert llm.results[0].lora_request == FakeLoRARequest("sql", lora_id("sql"), "/a/sql")
    await engine.abort("r1")
    await task
    with pytest.raises(NotFound):
        await collect(engine, request(request_id="r2", prompt="x", adapter="nope"), [])
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "adapter_config.json").write_text("{}")
    await engine.load_adapter("fr", str(tmp_path / "fr"))
    assert engine.adapters == ("fr", "sql")
    with pytest.raises(InvalidRequest) as no_folder:
        await engine.load_adapter("x", str(tmp_path / "missing"))
    assert field_of(no_folder) == "adapter"
    await engine.unload_adapter("fr")
    assert engine.adapters == ("sql",)

    def gone(name: str, int_id: int, path: str) -> None:
        raise ValueError(f"lora_path ({path}) does not exist.")  # LoRARequest.__post_init__

    engine._lora_request_type = gone
    with pytest.raises(InvalidRequest) as removed:
        await collect(engine, request(request_id="r3", prompt="x", adapter="sql"), [])
    assert field_of(removed) == "adapter" and "does not exist" in removed.value.violations[0].description
    await engine.shutdown()


async def test_without_lora_a_request_naming_an_adapter_is_not_found_and_none_loads(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    assert "lora_config" not in llm.kwargs and engine.adapters == ()
    with pytest.raises(NotFound):
        await collect(engine, request(prompt="x", adapter="sql"), [])
    with pytest.raises(InvalidRequest) as off:
        await engine.load_adapter("sql", "/a/sql")
    assert field_of(off) == "adapter" and "LLAMAMESH_TRTLLM_ENABLE_LORA" in off.value.violations[0].description
    await engine.shutdown()


# --- streaming


async def test_a_stream_yields_deltas_and_a_final_one_with_the_prompt_tokens(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    got: list[TokenDelta] = []
    req = request(prompt="one two", sampling=SamplingParams(stop=("###",), top_k=-1, seed=7))
    task = asyncio.create_task(collect(engine, req, got))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    result = llm.results[0]
    assert result.prompt_token_ids == [1, 103, 103]
    assert result.sampling_params.kwargs == {
        "max_tokens": 256,
        "temperature": 1.0,
        "seed": 7,
        "top_k": 0,
        "stop": ["###"],
    }
    result.respond(" a", (5,))
    result.respond("", ())  # nothing new: skipped
    result.respond(" b", (6,))
    result.respond("", (), finish="stop", stop_reason="###")  # text cut at the stop string
    await asyncio.wait_for(task, 5)
    assert [(d.text, d.token_ids, d.finish_reason, d.prompt_tokens) for d in got] == [
        (" a", (5,), None, None),
        (" b", (6,), None, None),
        ("", (), FinishReason.STOP_SEQUENCE, 3),
    ]
    assert "".join(d.text for d in got) == result.outputs[0].text  # deltas, never the text again
    assert result.abort_calls == 0 and engine.aborted == [] and not engine._streams
    await engine.abort("r1")  # finished: nothing to abort
    assert result.abort_calls == 0 and engine.aborted == []
    await engine.shutdown()


async def test_a_stop_string_other_tokens_spell_ends_the_request_here_and_aborts_it(trt: SimpleNamespace) -> None:
    """TensorRT-LLM checks stop strings as token ids: text that spells one with other tokens goes on
    generating there. The adapter finds it in the text, ends the stream at it and aborts the rest."""
    engine, llm = await started()
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(engine, request(prompt="x", sampling=SamplingParams(stop=(" END",))), got))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    result = llm.results[0]
    result.respond(" Hi", (10,))
    result.respond(" E", (12,))
    result.respond("NDless", (13,))
    await asyncio.wait_for(task, 5)
    assert [(d.text, d.finish_reason) for d in got] == [(" Hi", None), ("", None), ("", FinishReason.STOP_SEQUENCE)]
    assert result.abort_calls == 1
    await engine.shutdown()


async def test_with_min_tokens_stop_strings_are_found_here_only_past_them(trt: SimpleNamespace) -> None:
    """TensorRT-LLM ends at a stop string in its text whatever min_tokens says (result.py): with
    min_tokens the stop strings are not given to it, and the adapter ends the stream at the first one
    past min_tokens."""
    engine, llm = await started()
    got: list[TokenDelta] = []
    params = SamplingParams(stop=(" END",), min_tokens=3)
    task = asyncio.create_task(collect(engine, request(prompt="x", sampling=params), got))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    result = llm.results[0]
    assert "stop" not in result.sampling_params.kwargs and result.sampling_params.kwargs["min_tokens"] == 3
    result.respond(" END", (10,))  # before min_tokens: text like any other
    result.respond(" a", (11,))
    result.respond(" END", (12,))
    await asyncio.wait_for(task, 5)
    assert "".join(d.text for d in got) == " END a" and got[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert result.abort_calls == 1
    await engine.shutdown()


@pytest.mark.parametrize(
    ("finish", "stop_reason", "expected"),
    [("length", None, FinishReason.LENGTH), ("stop", None, FinishReason.STOP), ("stop", 7, FinishReason.STOP)],
)
async def test_stream_finish_reasons(
    trt: SimpleNamespace, finish: str, stop_reason: Any, expected: FinishReason
) -> None:
    engine, llm = await started()
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(engine, request(prompt="x"), got))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    llm.results[0].respond(" a", (5,), finish=finish, stop_reason=stop_reason)
    await asyncio.wait_for(task, 5)
    assert got == [TokenDelta(text=" a", token_ids=(5,), finish_reason=expected, prompt_tokens=2)]
    await engine.shutdown()


async def test_a_resumed_request_prefills_its_tokens_and_counts_only_the_prompt(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    got: list[TokenDelta] = []
    req = request(prompt="one two", resume_token_ids=(50, 51), sampling=SamplingParams(logprobs=0))
    task = asyncio.create_task(collect(engine, req, got))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    result = llm.results[0]
    assert result.prompt_token_ids == [1, 103, 103, 50, 51]
    assert result.sampling_params.kwargs["logprobs"] == 1
    result.respond(" c", (52,), logprobs=[{52: Lp(-0.5, 1), 53: Lp(-1.0, 2)}], finish="length")
    await asyncio.wait_for(task, 5)
    assert got[-1].token_ids == (52,) and got[-1].prompt_tokens == 3
    assert got[-1].logprobs[0].logprob == -0.5 and got[-1].logprobs[0].top == ()
    await engine.shutdown()


async def test_messages_go_through_the_chat_template_and_tokenize_matches(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    req = request(messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi")))
    ids = await engine.tokenize(req)
    assert ids == [108, 102, 105, 106, 102, 111]  # no BOS on top of the template's own
    task = asyncio.create_task(collect(engine, req, []))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    assert llm.results[0].prompt_token_ids == ids
    await engine.abort("r1")
    await asyncio.wait_for(task, 5)
    await engine.shutdown()


# --- errors (aborts, consumers that leave and shutdown: test_library_engines.py, for both adapters)


async def test_invalid_sampling_is_refused_naming_the_field(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    FakeSamplingParams.unsupported = frozenset({"min_p"})  # a release whose SamplingParams lacks it
    with pytest.raises(InvalidRequest) as exc:
        await anext_of(engine.stream(request(prompt="x", sampling=SamplingParams(min_p=0.1))))
    assert field_of(exc) == "min_p"
    with pytest.raises(InvalidRequest) as exc:
        await anext_of(engine.stream(request(prompt="x", sampling=SamplingParams(top_p=1.5))))
    assert field_of(exc) == "top_p"
    llm.submit_error = ValueError(
        "The sum of prompt length (3.0), query length (0) should not exceed max_num_tokens (2)"
    )
    with pytest.raises(PromptTooLong) as too_long:
        await anext_of(engine.stream(request(messages=(ChatMessage("user", "hi"),))))
    assert field_of(too_long) == "messages"
    with pytest.raises(InvalidRequest) as kind:
        await anext_of(engine.stream(request(prompt="x", kind=JobKind.TOKENIZE)))
    assert field_of(kind) == "kind"
    assert not engine._streams and llm.results == []
    await engine.check_health()  # none of that hurt the engine
    await engine.shutdown()


async def test_a_known_max_seq_len_is_checked_before_trtllm(trt: SimpleNamespace) -> None:
    engine, llm = await started(TrtllmSettings(max_seq_len=3))
    with pytest.raises(PromptTooLong):
        await anext_of(engine.stream(request(prompt="a b c")))
    assert llm.results == []
    await engine.shutdown()


async def test_a_request_error_fails_the_request_only(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    task = asyncio.create_task(collect(engine, request(prompt="x"), []))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    llm.results[0].fail(FakeRequestError("Encountered an error in forwardAsync"))
    with pytest.raises(InternalError):
        await asyncio.wait_for(task, 5)
    await engine.check_health()
    await engine.shutdown()


async def test_an_engine_error_after_start_is_a_dead_engine(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(engine, request(prompt="x"), got))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    llm.results[0].respond(" a", (5,))
    await until(lambda: len(got) == 1, 5, "the first delta")
    llm.results[0].fail(RuntimeError("Executor worker returned error"))  # a background error
    with pytest.raises(EngineDead):
        await asyncio.wait_for(task, 5)
    with pytest.raises(EngineDead):
        await engine.check_health()
    with pytest.raises(EngineDead):
        await anext_of(engine.stream(request(prompt="x", request_id="r2")))
    await engine.shutdown()


async def test_a_shut_down_llm_is_a_dead_engine(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    llm.submit_error = RuntimeError("LLM is shutting down")
    with pytest.raises(EngineDead):
        await anext_of(engine.stream(request(prompt="x")))
    with pytest.raises(EngineDead):
        await engine.check_health()
    await engine.shutdown()


async def test_trtllms_health_check_is_asked(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    await engine.check_health()
    llm.healthy = False
    with pytest.raises(EngineDead):
        await engine.check_health()
    await engine.shutdown()


# --- stats


async def test_stats_come_from_trtllms_iteration_stats(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    assert engine.stats() == EngineStats(steps=0)
    assert llm.stats_timeouts == []  # none before the first request (TensorRT-LLM would print a warning)
    task = asyncio.create_task(collect(engine, request(prompt="x"), []))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    stat = {"numActiveRequests": 5, "numQueuedRequests": 2, "kvCacheStats": {"usedNumBlocks": 30, "maxNumBlocks": 120}}
    llm.pending_stats += [{"iter": 1}, stat]
    busy = EngineStats(running=5, waiting=2, kv_cache_usage=0.25, steps=0)
    await until(engine.stats, 5, "the stats of the iteration", done=lambda got: got == busy)
    assert llm.stats_timeouts[0] == 0.01
    llm.results[0].respond(" a", (5,), finish="length")
    await asyncio.wait_for(task, 5)
    # Idle: no stats arrive and nothing is in flight; the KV figure stays as last seen. One output came.
    idle = EngineStats(running=0, waiting=0, kv_cache_usage=0.25, steps=1)
    await until(engine.stats, 5, "the idle stats", done=lambda got: got == idle)
    await engine.shutdown()
    assert engine._stats_task is None


# --- the registry builds it without TensorRT-LLM


def test_registry_builds_the_trtllm_engine_without_importing_tensorrt_llm() -> None:
    settings = Settings.from_env(
        {
            "LLAMAMESH_WORKER_ENGINE": "trtllm",
            "LLAMAMESH_WORKER_MODEL_PATH": "/m",
            "LLAMAMESH_TRTLLM_MAX_BATCH_SIZE": "64",
        }
    )
    engine = registry.create(settings)
    assert isinstance(engine, TrtllmEngine) and engine.model_name == settings.worker.model
    assert engine._trtllm_settings.max_batch_size == 64
    assert "tensorrt_llm" not in sys.modules


async def test_a_response_format_goes_as_guided_decoding_and_a_resume_of_one_is_refused(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    choice = ResponseConstraint(ConstraintKind.CHOICE, options=("yes", "no"))
    task = asyncio.create_task(collect(engine, request(prompt="x", sampling=SamplingParams(constraint=choice)), []))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    guided = llm.results[0].sampling_params.kwargs["guided_decoding"]
    assert isinstance(guided, FakeGuidedDecodingParams) and guided.kwargs == {"grammar": 'root ::= "yes" | "no"'}
    llm.results[0].respond("", (), finish="stop")
    await asyncio.wait_for(task, 5)
    resumed = request(request_id="r2", prompt="x", resume_token_ids=(5,), sampling=SamplingParams(constraint=choice))
    with pytest.raises(Unavailable, match="cannot resume"):
        await anext_of(engine.stream(resumed))
    # TensorRT-LLM compiles a constraint only in its executor loop: one that cannot compile is refused first.
    for kind, text, field in (
        (ConstraintKind.JSON_SCHEMA, '{"type": 5}', "response_format.json_schema"),
        (ConstraintKind.REGEX, "a(b", "response_format.regex"),
        (ConstraintKind.GRAMMAR, "root ::= ", "response_format.grammar"),
    ):
        bad = SamplingParams(constraint=ResponseConstraint(kind, text=text))
        with pytest.raises(InvalidRequest) as refused:
            await anext_of(engine.stream(request(request_id="r3", prompt="x", sampling=bad)))
        assert field_of(refused) == field, refused.value
    assert len(llm.results) == 1
    await engine.shutdown()


async def test_a_tenants_cache_salt_goes_with_its_request(trt: SimpleNamespace) -> None:
    engine, llm = await started()
    task = asyncio.create_task(collect(engine, dataclasses.replace(request(prompt="x"), cache_salt="s1"), []))
    await until(lambda: bool(llm.results), 5, "TensorRT-LLM to have the request")
    assert llm.results[0].cache_salt == "s1"
    await engine.abort("r1")
    await task
    plain = asyncio.create_task(collect(engine, request(request_id="r2", prompt="x"), []))
    await until(lambda: len(llm.results) == 2, 5, "TensorRT-LLM to have r2")
    assert llm.results[1].cache_salt is None  # none given: the library's default (shared)
    await engine.abort("r2")
    await plain
    await engine.shutdown()
