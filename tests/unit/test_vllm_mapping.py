"""The vllm engine without vLLM: the pure mappings (settings -> AsyncEngineArgs kwargs, SamplingParams ->
vLLM kwargs, vLLM outputs -> TokenDelta, vLLM errors -> ours), and the adapter's stream/abort control flow
driven by a fake AsyncLLM that follows vLLM 0.26's generate()/abort() (v1/engine/async_llm.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import AsyncIterator, Iterable
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from structlog.testing import capture_logs

from llamamesh.errors import EngineDead, InternalError, InvalidRequest, NotFound, PromptTooLong, Unavailable
from llamamesh.settings import BatchSettings, Settings, VllmSettings, WorkerSettings
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
from workers.engines.constraints import vllm_structured
from workers.engines.params import DEFAULT_MAX_TOKENS
from workers.engines.prompts import render_prompt_ids
from workers.engines.vllm import VllmEngine
from workers.engines.vllm_args import (
    BATCH_STEP_TOKENS,
    SWAP_SPACE_GONE,
    check_engine_fields,
    engine_error_field,
    engine_kwargs,
    for_worker,
)
from workers.engines.vllm_outputs import delta_of, engine_timings
from workers.engines.vllm_requests import BATCH_PRIORITY_OFFSET, engine_priority, invalid_from_vllm, sampling_kwargs
from workers.engines.vllm_stats import SchedulerSnapshot

pytestmark = pytest.mark.timeout(10)

WORKER = WorkerSettings(model="llama-8b", model_path="/models/llama")


def field_of(exc: pytest.ExceptionInfo[InvalidRequest]) -> str:
    return exc.value.violations[0].field


# --- engine arguments


def test_minimal_engine_args_pass_only_the_model_and_the_gpus() -> None:
    assert engine_kwargs(WORKER, VllmSettings(), device_count=1) == {
        "model": "/models/llama",
        "served_model_name": "llama-8b",
        "tensor_parallel_size": 1,
        "scheduling_policy": "priority",
    }


@pytest.mark.parametrize(("setting", "devices", "expected"), [(0, 4, 4), (0, 0, 1), (2, 8, 2), (1, 4, 1)])
def test_tensor_parallel_size_defaults_to_every_visible_gpu(setting: int, devices: int, expected: int) -> None:
    kwargs = engine_kwargs(WORKER, VllmSettings(tensor_parallel_size=setting), device_count=devices)
    assert kwargs["tensor_parallel_size"] == expected


def test_every_engine_setting_is_forwarded_verbatim() -> None:
    settings = VllmSettings(
        tokenizer="/tok",
        dtype="bfloat16",
        tensor_parallel_size=2,
        max_model_len=8192,
        gpu_memory_utilization=0.85,
        block_size=32,
        enable_prefix_caching=False,
        quantization="fp8",
        load_format="dummy",
        enforce_eager=True,
        max_num_seqs=512,
        max_num_batched_tokens=16384,
        swap_space=4.0,
        seed=7,
        scheduling_policy="fcfs",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=32,
        extra_args='{"kv_cache_dtype": "fp8", "compilation_config": {"level": 3}}',
    )
    assert engine_kwargs(WORKER, settings, device_count=8) == {
        "model": "/models/llama",
        "served_model_name": "llama-8b",
        "tokenizer": "/tok",
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.85,
        "block_size": 32,
        "enable_prefix_caching": False,
        "quantization": "fp8",
        "load_format": "dummy",
        "enforce_eager": True,
        "max_num_seqs": 512,
        "max_num_batched_tokens": 16384,
        "swap_space": 4.0,
        "seed": 7,
        "scheduling_policy": "fcfs",
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 32,
        "kv_cache_dtype": "fp8",
        "compilation_config": {"level": 3},
    }
    # Every VllmSettings field is covered: each maps to a kwarg of its own name (extra_args merges).
    # frontends is ours (how many processes share the engine), not an engine argument.
    names = {f.name for f in dataclasses.fields(VllmSettings)} - {"extra_args", "frontends"}
    assert names <= set(engine_kwargs(WORKER, settings, device_count=8))


def test_worker_adapters_turn_lora_on_with_stable_ids() -> None:
    worker = dataclasses.replace(WORKER, adapters="sql=/a/sql,fr=/a/fr")
    assert engine_kwargs(worker, VllmSettings(), device_count=1)["enable_lora"] is True
    assert "enable_lora" not in engine_kwargs(WORKER, VllmSettings(), device_count=1)
    assert lora_id("sql") == lora_id("sql") > 0 and lora_id("sql") != lora_id("fr")


async def test_a_request_with_an_adapter_goes_with_its_lora_request_and_an_unknown_one_is_not_found() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm)
    engine._adapters = {"sql": "/a/sql"}
    engine._api.LoRARequest = lambda name, i, path: ("lora", name, i, path)  # type: ignore[attr-defined]
    seen: dict[str, Any] = {}
    generate = llm.generate

    def spy(prompt: Any, params: Any, request_id: str, **kw: Any) -> Any:
        seen.update(kw)
        return generate(prompt, params, request_id, priority=kw.get("priority", 0))

    llm.generate = spy  # type: ignore[method-assign]
    task = asyncio.create_task(collect(engine, request(prompt="x", adapter="sql"), []))
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have r1")
    assert seen["lora_request"] == ("lora", "sql", lora_id("sql"), "/a/sql")
    llm.emit("r1", output(" a", [5], finish="length"))
    await asyncio.wait_for(task, 5)
    with pytest.raises(NotFound):
        await collect(engine, request(request_id="r2", prompt="x", adapter="nope"), [])
    await engine.shutdown()


async def test_a_tenants_cache_salt_goes_with_its_prompt() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm)
    prompts: list[Any] = []
    generate = llm.generate

    def spy(prompt: Any, params: Any, request_id: str, **kw: Any) -> Any:
        prompts.append(prompt)
        return generate(prompt, params, request_id, priority=kw.get("priority", 0))

    llm.generate = spy  # type: ignore[method-assign]
    for rid, salt in (("r1", "s1"), ("r2", "")):
        task = asyncio.create_task(
            collect(engine, dataclasses.replace(request(request_id=rid, prompt="x"), cache_salt=salt), [])
        )
        await until(lambda rid=rid: rid in llm.queues, 5, f"vLLM to have {rid}")  # type: ignore[misc]
        llm.emit(rid, output(" a", [5], finish="length"))
        await asyncio.wait_for(task, 5)
    assert prompts[0]["cache_salt"] == "s1" and "cache_salt" not in prompts[1]
    await engine.shutdown()


def test_unset_sentinels_keep_vllms_defaults() -> None:
    kwargs = engine_kwargs(WORKER, VllmSettings(enforce_eager=False, seed=0, gpu_memory_utilization=0.0), 1)
    for name in (
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
        "enable_prefix_caching",
    ):
        assert name not in kwargs


@pytest.mark.parametrize(
    ("share", "budget", "expected"),
    [
        (1.0, 0, BATCH_STEP_TOKENS),  # a batch worker: twice offline LLM's step budget
        (0.5, 0, 0),  # a mixed worker: vLLM's server default (shorter steps)
        (0.99, 0, 0),
        (1.0, 4096, 4096),  # set: kept
    ],
)
def test_the_step_budget_follows_what_the_worker_serves(share: float, budget: int, expected: int) -> None:
    chosen = for_worker(VllmSettings(max_num_batched_tokens=budget), BatchSettings(max_share=share))
    assert chosen.max_num_batched_tokens == expected
    assert engine_kwargs(WORKER, chosen, 1).get("max_num_batched_tokens", 0) == expected


def test_batch_items_come_after_every_interactive_request_under_the_priority_policy() -> None:
    interactive = [request(priority=p) for p in (-5, 0, 10)]
    batch = [dataclasses.replace(request(priority=p), batch_id="b1", custom_id="c") for p in (-5, 0, 10)]
    # vLLM schedules lower values first: ours higher first, and any interactive before any batch item.
    assert [engine_priority(r, "priority") for r in interactive] == [5, 0, -10]
    assert min(engine_priority(r, "priority") for r in batch) > max(engine_priority(r, "priority") for r in interactive)
    assert engine_priority(batch[0], "priority") == 5 + BATCH_PRIORITY_OFFSET
    # fcfs: vLLM refuses any priority but 0.
    assert {engine_priority(r, "fcfs") for r in interactive + batch} == {0}


def test_an_unknown_scheduling_policy_names_its_setting() -> None:
    with pytest.raises(InvalidRequest) as exc:
        engine_kwargs(WORKER, VllmSettings(scheduling_policy="lifo"), 1)
    assert field_of(exc) == "vllm.scheduling_policy"


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("TRUE", True), (" false ", False), ("", None)])
def test_enable_prefix_caching_is_tri_state(raw: str, expected: bool | None) -> None:
    vllm = Settings.from_env({"LLAMAMESH_VLLM_ENABLE_PREFIX_CACHING": raw}).vllm
    assert engine_kwargs(WORKER, vllm, 1).get("enable_prefix_caching") is expected


def test_bad_engine_settings_name_their_setting() -> None:
    with pytest.raises(ValueError, match="LLAMAMESH_VLLM_ENABLE_PREFIX_CACHING='maybe'"):
        VllmSettings(enable_prefix_caching="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE=-1: expected an integer, 0 or more"):
        VllmSettings(tensor_parallel_size=-1)
    with pytest.raises(InvalidRequest) as exc:
        engine_kwargs(WorkerSettings(model_path=""), VllmSettings(), 1)
    assert field_of(exc) == "worker.model_path"


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"fp8"', "3"])
def test_bad_extra_args_name_vllm_extra_args(raw: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        engine_kwargs(WORKER, VllmSettings(extra_args=raw), 1)
    assert field_of(exc) == "vllm.extra_args"


@pytest.mark.parametrize(
    ("key", "env"),
    [
        ("dtype", "LLAMAMESH_VLLM_DTYPE"),
        ("tensor_parallel_size", "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE"),
        ("model", "LLAMAMESH_WORKER_MODEL_PATH"),
        ("served_model_name", "LLAMAMESH_WORKER_MODEL"),
    ],
)
def test_extra_args_may_not_shadow_a_setting(key: str, env: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        engine_kwargs(WORKER, VllmSettings(extra_args=json.dumps({key: "x"})), 1)
    assert field_of(exc) == "vllm.extra_args"
    assert env in exc.value.message


def test_fields_asyncengineargs_lacks_are_refused_with_their_setting() -> None:
    known = {"model", "served_model_name", "tensor_parallel_size", "kv_cache_dtype"}
    check_engine_fields({"model": "m", "kv_cache_dtype": "fp8"}, known, {"kv_cache_dtype"})
    with pytest.raises(InvalidRequest) as exc:
        check_engine_fields({"model": "m", "swap_space": 4.0}, known, set())
    assert field_of(exc) == "vllm.swap_space"
    assert exc.value.violations[0].description == SWAP_SPACE_GONE
    with pytest.raises(InvalidRequest) as exc:
        check_engine_fields({"model": "m", "no_such_arg": 1}, known, {"no_such_arg"})
    assert field_of(exc) == "vllm.extra_args"
    assert "no_such_arg" in exc.value.message


def test_vllm_config_errors_are_pinned_to_a_setting() -> None:
    keys = {"model", "served_model_name", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "foo"}
    # A pydantic location wins.
    assert engine_error_field("anything", ["gpu_memory_utilization"], keys, set()) == "vllm.gpu_memory_utilization"
    # Else the key the message names first (whole words only: not inside max_model_len).
    msg = "1 validation error for CacheConfig\ngpu_memory_utilization\n  Input should be <= 1; see max_model_len"
    assert engine_error_field(msg, [], keys, set()) == "vllm.gpu_memory_utilization"
    assert engine_error_field("Total heads must divide tensor_parallel_size", [], keys, set()) == (
        "vllm.tensor_parallel_size"
    )
    assert engine_error_field("bad foo value", [], keys, {"foo"}) == "vllm.extra_args"
    # "model" is everywhere in vLLM's messages, so only a location names it.
    assert engine_error_field("the model is broken", [], keys, set()) == "vllm"
    assert engine_error_field("x", ["model"], keys, set()) == "worker.model_path"


# --- sampling


def test_unset_sampling_keeps_vllms_defaults_except_ours() -> None:
    assert sampling_kwargs(SamplingParams()) == {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 1.0}
    assert DEFAULT_MAX_TOKENS == 256


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
        n=3,
    )
    kwargs = sampling_kwargs(params, vocab_size=100)
    assert kwargs == {
        "max_tokens": 12,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "stop": ["###", "\n\n"],
        "stop_token_ids": [2, 7],
        "seed": 0,
        "ignore_eos": False,
        "min_tokens": 3,
        "logprobs": 5,
        "n": 3,
    }
    # Same names on both sides, and none forgotten if a field is added to SamplingParams.
    # (constraint: stream() adds it as the library's own parameter object; tests/unit/test_constraints.py)
    assert set(kwargs) | {"constraint"} == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_off_is_vllms_zero(top_k: int, expected: int) -> None:
    assert sampling_kwargs(SamplingParams(top_k=top_k))["top_k"] == expected


def test_greedy_and_zero_values_are_kept_not_defaulted() -> None:
    kwargs = sampling_kwargs(SamplingParams(temperature=0.0, min_tokens=0, logprobs=0, presence_penalty=0.0))
    assert kwargs["temperature"] == 0.0
    assert kwargs["min_tokens"] == 0 and kwargs["logprobs"] == 0 and kwargs["presence_penalty"] == 0.0


def test_stop_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest) as exc:
        sampling_kwargs(SamplingParams(stop_token_ids=(5, 100)), vocab_size=100)
    assert field_of(exc) == "stop_token_ids"
    assert sampling_kwargs(SamplingParams(stop_token_ids=(100,)))["stop_token_ids"] == [100]


@pytest.mark.parametrize(
    ("message", "parameter", "field", "too_long"),
    [
        ("temperature must be in [0, 2], got 3.0.", "temperature", "temperature", False),
        ("Requested sample logprobs of 25, which is greater than max allowed: 20", "logprobs", "logprobs", False),
        ("min_p must be in [0, 1], got 2.0.", None, "min_p", False),
        ("min_tokens must be less than or equal to max_tokens=4, got 5.", None, "min_tokens", False),
        ("top_k must be 0 (disable), or at least 1, got -5.", None, "top_k", False),
        ("stop cannot contain an empty string.", None, "stop", False),
        ("presence_penalty must be in [-2, 2], got 3.", None, "presence_penalty", False),
        (
            "The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure",
            None,
            "messages",
            True,
        ),
        (
            "The decoder prompt (length 4096) plus the number of requested output tokens (at least 1) is longer "
            "than the maximum model length of 4096.",
            None,
            "messages",
            True,
        ),
        ("The decoder prompt cannot be empty", None, "messages", False),
        ("Token id 99999 is out of vocabulary", None, "messages", False),
        ("This model does not support generation", None, "request", False),
    ],
)
def test_vllm_validation_errors_name_our_field(message: str, parameter: str | None, field: str, too_long: bool) -> None:
    err = invalid_from_vllm(message, parameter, "messages")
    assert err.violations[0].field == field
    assert isinstance(err, PromptTooLong) is too_long
    assert err.violations[0].description == message


# --- prompts


class StubTokenizer:
    """A tokenizer with the HF surface the engine uses: one id per word, BOS=1 with special tokens."""

    def __init__(self, chat_template: str | None = "{{ messages }}", fail: bool = False) -> None:
        self.chat_template = chat_template
        self.fail = fail
        self.calls: list[tuple[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(("encode", add_special_tokens))
        return ([1] if add_special_tokens else []) + [100 + len(w) for w in text.split()]

    def apply_chat_template(
        self, chat: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool, chat_template: str = ""
    ) -> str:
        self.calls.append(("template", (tokenize, add_generation_prompt)))
        if self.fail:
            raise ValueError("roles must alternate")
        return "<s> " + " ".join(f"<{m['role']}> {m['content']}" for m in chat) + " <assistant>"


def request(**kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=kw.pop("request_id", "r1"), model="llama-8b", **kw)


def test_prompts_keep_special_tokens_and_messages_go_through_the_template() -> None:
    tok = StubTokenizer()
    assert render_prompt_ids(request(prompt="hi there"), tok) == [1, 102, 105]
    assert tok.calls == [("encode", True)]
    tok = StubTokenizer()
    ids = render_prompt_ids(request(messages=(ChatMessage("user", "hi"),)), tok)
    # The template's own "<s>" is the only BOS: no special tokens are added on top.
    assert ids == [103, 106, 102, 111]
    assert tok.calls == [("template", (False, True)), ("encode", False)]


@pytest.mark.parametrize(
    ("kw", "tok", "field"),
    [
        (dict(prompt="a", messages=(ChatMessage("user", "b"),)), StubTokenizer(), "messages"),
        (dict(messages=()), StubTokenizer(), "messages"),
        (dict(messages=(ChatMessage("user", "b"),)), StubTokenizer(chat_template=None), "messages"),
        (dict(messages=(ChatMessage("user", "b"),)), StubTokenizer(fail=True), "messages"),
        (dict(), StubTokenizer(), "prompt"),
    ],
)
def test_unusable_input_names_its_field(kw: dict[str, Any], tok: StubTokenizer, field: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        render_prompt_ids(request(**kw), tok)
    assert field_of(exc) == field


# --- outputs


class Lp(NamedTuple):
    """vllm.logprobs.Logprob's fields."""

    logprob: float
    rank: int | None
    decoded_token: str | None = None


def output(
    text: str = "",
    ids: Iterable[int] = (),
    finish: str | None = None,
    stop_reason: int | str | None = None,
    logprobs: list[dict[int, Lp]] | None = None,
    prompt_ids: Iterable[int] = (1, 2, 3),
) -> SimpleNamespace:
    """A vllm.outputs.RequestOutput of one completion (the fields the engine reads)."""
    completion = SimpleNamespace(
        text=text, token_ids=list(ids), logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason
    )
    return SimpleNamespace(prompt_token_ids=list(prompt_ids), outputs=[completion], finished=finish is not None)


def test_deltas_carry_prompt_tokens_on_the_final_one_only() -> None:
    assert delta_of(output(" hi", [5]), None) == TokenDelta(text=" hi", token_ids=(5,))
    final = delta_of(output("", [2], finish="stop", stop_reason="###", prompt_ids=range(7)), None)
    assert final == TokenDelta(token_ids=(2,), finish_reason=FinishReason.STOP_SEQUENCE, prompt_tokens=7)
    with_lp = delta_of(output(" a b", [5, 6], logprobs=[{5: Lp(-0.1, 1)}, {6: Lp(-0.2, 1)}]), 0)
    assert [lp.token_id for lp in with_lp.logprobs] == [5, 6]


def test_engine_timings_split_vllms_time_to_first_token() -> None:
    stats = SimpleNamespace(
        first_token_latency=0.5, queued_ts=10.0, scheduled_ts=10.3, first_token_ts=10.45, last_token_ts=11.45
    )
    timed = dict(engine_timings(SimpleNamespace(metrics=stats), 1.234, now=11.5))
    assert timed == {
        "tokenize": 1.23,
        "vllm_ttft": 500.0,
        "vllm_queue": 300.0,
        "vllm_prefill": 150.0,
        "vllm_decode": 1000.0,
        "vllm_delivery": 50.0,
    }
    # Stats off (metrics None), or a request that never produced a token: our part only.
    assert engine_timings(SimpleNamespace(metrics=None), 2.0) == (("tokenize", 2.0),)
    unscheduled = SimpleNamespace(first_token_latency=0.0, queued_ts=1.0, scheduled_ts=0.0, first_token_ts=0.0)
    assert engine_timings(SimpleNamespace(metrics=unscheduled), 2.0) == (("tokenize", 2.0),)
    # The engine core's stats off (disable_log_stats): no queue or schedule times, so no queue/prefill.
    core_off = SimpleNamespace(
        first_token_latency=0.06, queued_ts=0.0, scheduled_ts=0.0, first_token_ts=440.1, last_token_ts=440.9
    )
    timed = dict(engine_timings(SimpleNamespace(metrics=core_off), 2.0, now=441.0))
    assert set(timed) == {"tokenize", "vllm_ttft", "vllm_decode", "vllm_delivery"}, timed


def test_scheduler_snapshot_sums_engines() -> None:
    snap = SchedulerSnapshot()
    assert snap.stats() == EngineStats()
    snap.record(0, running=10, waiting=2, kv_cache_usage=0.5)
    snap.record(1, running=4, waiting=0, kv_cache_usage=0.25)
    snap.record(0, running=12, waiting=1, kv_cache_usage=0.75)
    assert snap.stats() == EngineStats(running=16, waiting=1, kv_cache_usage=0.5)


# --- the registry builds it without vLLM


def test_registry_builds_the_vllm_engine_without_importing_vllm() -> None:
    settings = Settings.from_env({}).with_overrides(
        worker={"engine": "vllm", "model_path": "/m", "max_inflight": 32}, vllm={"max_num_seqs": 512}
    )
    with capture_logs() as logs:
        engine = registry.create(settings)
    assert isinstance(engine, VllmEngine) and engine.model_name == settings.worker.model
    assert "vllm" not in sys.modules
    assert [e for e in logs if e["event"] == "vllm_underfed"] == [
        {
            "event": "vllm_underfed",
            "log_level": "warning",
            "max_inflight": 32,
            "max_num_seqs": 512,
            "hint": "set LLAMAMESH_WORKER_MAX_INFLIGHT >= max_num_seqs so the worker keeps vLLM's batch full",
        }
    ]
    with capture_logs() as logs:
        registry.create(settings.with_overrides(worker={"max_inflight": 512}))
    assert not [e for e in logs if e["event"] == "vllm_underfed"]
    fake = registry.create(settings.with_overrides(worker={"engine": "fake"}))
    assert type(fake).__name__ == "FakeEngine"
    with pytest.raises(InvalidRequest) as exc:
        registry.create(settings.with_overrides(worker={"engine": "nope"}))
    assert field_of(exc) == "worker.engine"


# --- the adapter's control flow, with a fake AsyncLLM


class FakeEngineDeadError(Exception):
    pass


class FakeEngineGenerateError(Exception):
    pass


class FakeAsyncLLM:
    """AsyncLLM 0.26's request path, reduced: generate() registers the request on its first step, yields
    outputs until a finished one, and on CancelledError/GeneratorExit aborts the request itself
    (async_llm.py:591-597); abort(external id) ends a known request with a final "abort" output
    (output_processor.abort_requests) and ignores unknown ones."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.seen: dict[str, tuple[Any, dict[str, Any], int]] = {}
        self.internal_aborts: list[str] = []
        self.abort_calls: list[list[str]] = []
        self.fail_with: BaseException | None = None
        self.errored = False
        self.shut_down = False

    async def generate(
        self, prompt: Any, params: dict[str, Any], request_id: str, *, priority: int = 0
    ) -> AsyncIterator[Any]:
        if self.fail_with is not None:
            raise self.fail_with
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request_id] = queue
        self.seen[request_id] = (prompt, params, priority)
        try:
            finished = False
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            # vLLM calls abort(internal=True) here even for a request that already finished.
            self.queues.pop(request_id, None)
            self.internal_aborts.append(request_id)
            raise

    def emit(self, rid: str, out: SimpleNamespace) -> None:
        queue = self.queues[rid] if not out.finished else self.queues.pop(rid)
        queue.put_nowait(out)

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.abort_calls.append(ids)
        for rid in ids:
            queue = self.queues.pop(rid, None)
            if queue is not None:
                queue.put_nowait(output(finish="abort", prompt_ids=self.seen[rid][0]["prompt_token_ids"]))

    async def check_health(self) -> None:
        if self.errored:
            raise FakeEngineDeadError("EngineCore encountered an issue.")

    def shutdown(self) -> None:
        self.shut_down = True


def fake_sampling_params(**kw: Any) -> dict[str, Any]:
    if kw.get("temperature", 1.0) > 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {kw['temperature']}.")
    return kw


def started(llm: FakeAsyncLLM, tokenizer: Any = None, max_model_len: int = 4096) -> VllmEngine:
    """A VllmEngine whose start() ran against ``llm`` (its vLLM names replaced by fakes)."""
    engine = VllmEngine(
        WorkerSettings(model="llama-8b", model_path="/m", max_inflight=4),
        VllmSettings(),
        1,
        constraints=vllm_structured,
    )
    engine._llm = llm
    engine._api = SimpleNamespace(  # type: ignore[assignment]
        tokens_input=lambda ids, **kw: {"type": "token", "prompt_token_ids": ids, **kw},
        SamplingParams=fake_sampling_params,
        StructuredOutputsParams=lambda **kw: ("structured", kw),
        DELTA="delta",
        EngineDeadError=FakeEngineDeadError,
        EngineGenerateError=FakeEngineGenerateError,
    )
    engine._tokenizer = tokenizer or StubTokenizer()
    engine._max_model_len = max_model_len
    engine._vocab_size = 1000
    return engine


async def collect(engine: VllmEngine, req: GenerationRequest, into: list[TokenDelta]) -> None:
    async for delta in engine.stream(req):
        into.append(delta)


async def test_a_stream_maps_outputs_and_lets_generate_finish_by_itself() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm)
    got: list[TokenDelta] = []
    req = request(prompt="one two", sampling=SamplingParams(stop=("###",), logprobs=1), priority=3)
    task = asyncio.create_task(collect(engine, req, got))
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have r1")
    prompt, params, priority = llm.seen["r1"]
    assert prompt == {"type": "token", "prompt_token_ids": [1, 103, 103]}
    assert params == {"max_tokens": 256, "temperature": 1.0, "stop": ["###"], "logprobs": 1, "output_kind": "delta"}
    assert priority == -3  # ours: higher first; vLLM's: lower first
    llm.emit("r1", output(" a", [5], logprobs=[{5: Lp(-0.1, 1), 6: Lp(-2.0, 2)}], prompt_ids=[1, 103, 103]))
    llm.emit("r1", output("", [], prompt_ids=[1, 103, 103]))  # nothing new: skipped
    llm.emit(
        "r1", output(" b", [8], finish="stop", stop_reason="###", logprobs=[{8: Lp(-0.5, 1)}], prompt_ids=[1, 103, 103])
    )
    await asyncio.wait_for(task, 5)
    assert [(d.text, d.token_ids, d.finish_reason, d.prompt_tokens) for d in got] == [
        (" a", (5,), None, None),
        (" b", (8,), FinishReason.STOP_SEQUENCE, 3),
    ]
    assert [a.token_id for a in got[0].logprobs[0].top] == [5]
    assert llm.internal_aborts == [] and engine.aborted == [] and not engine._streams
    await engine.abort("r1")  # finished: nothing to abort
    assert engine.aborted == [] and llm.abort_calls == []
    await engine.shutdown()


def outputs_of(*completions: tuple[int, str, list[int], str | None], finished: bool = False) -> SimpleNamespace:
    """A RequestOutput of a request with n > 1: (sample index, text, ids, finish) per completion."""
    return SimpleNamespace(
        prompt_token_ids=[1, 103, 103],
        finished=finished,
        outputs=[
            SimpleNamespace(index=k, text=t, token_ids=ids, logprobs=None, finish_reason=f, stop_reason=None)
            for k, t, ids, f in completions
        ],
    )


async def test_n_samples_go_to_vllm_as_n_and_each_ends_on_its_own() -> None:
    """vLLM samples in parallel (one prefill): the adapter passes n and maps every completion of an
    output to a delta of its sample; a sample's end goes on, the last one ends the stream."""
    llm = FakeAsyncLLM()
    engine = started(llm)
    assert engine.parallel_samples
    got: list[TokenDelta] = []
    req = request(prompt="one two", sampling=SamplingParams(n=3, seed=4))
    task = asyncio.create_task(collect(engine, req, got))
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have r1")
    assert llm.seen["r1"][1]["n"] == 3 and llm.seen["r1"][1]["seed"] == 4
    llm.emit("r1", outputs_of((0, " a", [5], None), (1, " b", [6], None), (2, " c", [7], "stop")))
    llm.emit("r1", outputs_of((1, " d", [8], "length"), (0, " e", [9], None)))
    llm.emit("r1", outputs_of((0, "", [], "length"), finished=True))
    await asyncio.wait_for(task, 5)
    assert [(d.sample, d.token_ids, d.finish_reason, d.prompt_tokens) for d in got] == [
        (0, (5,), None, None),
        (1, (6,), None, None),
        (2, (7,), FinishReason.STOP, 3),
        (1, (8,), FinishReason.LENGTH, 3),
        (0, (9,), None, None),
        (0, (), FinishReason.LENGTH, 3),
    ]
    assert llm.internal_aborts == [] and not engine._streams
    await engine.shutdown()


async def test_a_resumed_request_feeds_the_sent_tokens_after_the_prompt() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm, max_model_len=6)
    got: list[TokenDelta] = []
    req = dataclasses.replace(request(prompt="one two"), resume_token_ids=(7, 8))
    task = asyncio.create_task(collect(engine, req, got))
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have r1")
    assert llm.seen["r1"][0] == {"type": "token", "prompt_token_ids": [1, 103, 103, 7, 8]}
    llm.emit("r1", output(" c", [9], finish="length", prompt_ids=[1, 103, 103, 7, 8]))
    await asyncio.wait_for(task, 5)
    assert [(d.token_ids, d.prompt_tokens) for d in got] == [((9,), 3)]  # the prompt alone
    # prompt + resumed tokens must leave room in the model's length
    too_long = dataclasses.replace(request(prompt="one two"), request_id="r2", resume_token_ids=(7, 8, 9))
    with pytest.raises(PromptTooLong):
        await collect(engine, too_long, [])
    await engine.shutdown()


async def test_vllm_errors_become_ours_before_any_delta() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm)
    with pytest.raises(InvalidRequest) as exc:
        await anext_of(engine.stream(request(prompt="x", sampling=SamplingParams(temperature=3.0))))
    assert field_of(exc) == "temperature"
    llm.fail_with = ValueError("The decoder prompt (length 3) is longer than the maximum model length of 2.")
    with pytest.raises(PromptTooLong) as too_long:
        await anext_of(engine.stream(request(messages=(ChatMessage("user", "hi"),))))
    assert too_long.value.violations[0].field == "messages"
    llm.fail_with = FakeEngineDeadError("EngineCore encountered an issue.")
    with pytest.raises(EngineDead):
        await anext_of(engine.stream(request(prompt="x")))
    llm.fail_with = FakeEngineGenerateError()
    with pytest.raises(InternalError):
        await anext_of(engine.stream(request(prompt="x")))
    llm.errored = True
    with pytest.raises(EngineDead):
        await anext_of(engine.stream(request(prompt="x")))
    with pytest.raises(EngineDead):
        await engine.check_health()
    llm.fail_with = None
    short = started(llm, max_model_len=2)
    with pytest.raises(PromptTooLong):  # our own check, before vLLM
        await anext_of(short.stream(request(prompt="a b")))
    await short.shutdown()
    with pytest.raises(InvalidRequest) as kind:
        await anext_of(engine.stream(request(prompt="x", kind=JobKind.TOKENIZE)))
    assert field_of(kind) == "kind"
    assert not engine._streams
    await engine.shutdown()


async def anext_of(stream: AsyncIterator[TokenDelta]) -> TokenDelta:
    return await stream.__anext__()


async def test_tokenize_matches_what_stream_sends() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm)
    req = request(messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi")))
    ids = await engine.tokenize(req)
    task = asyncio.create_task(collect(engine, req, []))
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have r1")
    assert llm.seen["r1"][0]["prompt_token_ids"] == ids
    await engine.abort("r1")
    await asyncio.wait_for(task, 5)
    await engine.shutdown()


def test_frontends_split_max_inflight_and_name_their_consumers() -> None:
    from workers.frontends import frontend_settings, split_inflight

    assert [split_inflight(1024, 4, i) for i in range(4)] == [256] * 4
    assert [split_inflight(10, 4, i) for i in range(4)] == [3, 3, 2, 2]
    assert [split_inflight(2, 4, i) for i in range(4)] == [1, 1, 1, 1]  # never zero
    base = Settings().with_overrides(worker={"consumer": "gpu-0", "max_inflight": 10}, vllm={"frontends": 4})
    shares = [frontend_settings(base, 4, i).worker for i in range(4)]
    assert [w.consumer for w in shares] == ["gpu-0-0", "gpu-0-1", "gpu-0-2", "gpu-0-3"]
    assert sum(w.max_inflight for w in shares) == 10
    with pytest.raises(ValueError, match="LLAMAMESH_VLLM_FRONTENDS=0: expected an integer, 1 or more"):
        VllmSettings(frontends=0)


async def test_a_response_format_goes_as_structured_outputs_and_a_resume_of_one_is_refused() -> None:
    llm = FakeAsyncLLM()
    engine = started(llm)
    schema = ResponseConstraint(ConstraintKind.JSON_SCHEMA, text='{"type": "object"}')
    task = asyncio.create_task(collect(engine, request(prompt="x", sampling=SamplingParams(constraint=schema)), []))
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have r1")
    _prompt, params, _priority = llm.seen["r1"]
    structured = {"json": '{"type": "object"}', "disable_any_whitespace": True}
    assert params["structured_outputs"] == ("structured", structured)
    llm.emit("r1", output("{}", [5], finish="stop", prompt_ids=[1, 103]))
    await asyncio.wait_for(task, 5)
    resumed = request(request_id="r2", prompt="x", sampling=SamplingParams(constraint=schema), resume_token_ids=(5,))
    with pytest.raises(Unavailable, match="vLLM cannot resume"):
        await collect(engine, resumed, [])
    await engine.shutdown()
