"""The Engine contract (workers/engines/base.py), asserted the same way for every engine.

Each test runs once per engine of ``backend`` (see conftest.py). Where engines legitimately differ (the
fake engine's tokens are synthetic, sampled text depends on the model) the tests assert properties:
lengths, finish reasons, text against the engine's own tokenizer, outputs against the same engine's
earlier outputs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import pytest
import pytest_asyncio

from llamamesh.errors import EngineDead, InvalidRequest, field_of
from llamamesh.settings import DEFAULT_MODEL
from llamamesh.types import ChatMessage, FinishReason, GenerationRequest, SamplingParams, TokenDelta
from tests.contract.conftest import MAX_MODEL_LEN, Backend, engine_of, settings_for
from workers.engines import registry
from workers.engines.base import EngineStats
from workers.samples import Samples

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

# A prompt with a long answer (greedy never ends it within REFERENCE_TOKENS) and one with a short
# answer (SmolLM2 ends it after about five tokens), so that ignore_eos / min_tokens have work to do.
LONG = "Write a short story about a lighthouse keeper."
SHORT = "Answer with one word: is water wet?"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2+2?", "Write a haiku about the sea."]
REFERENCE_TOKENS = 16
# How long an aborted stream may take to end (a CPU step is well under a second).
ABORT_WAIT_S = 10.0


def chat(question: str, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        model=DEFAULT_MODEL,
        messages=(ChatMessage("user", question),),
        sampling=SamplingParams(**sampling),
    )


@dataclass(frozen=True)
class Result:
    deltas: list[TokenDelta]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]

    @property
    def last(self) -> TokenDelta:
        return self.deltas[-1]


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


async def run(backend: Backend, request: GenerationRequest) -> Result:
    """The whole stream, checked for what every stream owes: only its last delta ends it and counts the prompt."""
    deltas = await collect(backend.engine.stream(request))
    assert deltas, "a stream must end with a delta that carries its finish_reason"
    for delta in deltas[:-1]:
        assert delta.finish_reason is None and delta.prompt_tokens is None, delta
    assert deltas[-1].finish_reason is not None and deltas[-1].prompt_tokens is not None, deltas[-1]
    return Result(deltas)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(backend: Backend) -> Result:
    """The engine's greedy answer to LONG, REFERENCE_TOKENS long."""
    return await run(backend, chat(LONG, temperature=0, max_tokens=REFERENCE_TOKENS, ignore_eos=True))


# --- 7. health (first: its timeout covers loading the model, and the GGUF conversion on a fresh machine)


@pytest.mark.timeout(300)
async def test_a_started_engine_is_healthy_and_idle(backend: Backend) -> None:
    await backend.engine.check_health()
    assert backend.engine.model_name == DEFAULT_MODEL
    stats = backend.engine.stats()
    assert isinstance(stats, EngineStats)
    assert stats.running == 0 and stats.waiting == 0
    assert 0.0 <= stats.kv_cache_usage <= 1.0


async def test_a_dead_engine_fails_health_and_requests(backend: Backend) -> None:
    if backend.name != "fake":
        pytest.skip(f"the {backend.name} engine offers no way to die in-process")
    engine = registry.create(settings_for(backend.name))
    await engine.start()
    try:
        engine.dead = True  # type: ignore[attr-defined]  # the fake engine's switch
        with pytest.raises(EngineDead):
            await engine.check_health()
        with pytest.raises(EngineDead):
            await anext(engine.stream(chat(SHORT, max_tokens=2)))
    finally:
        await engine.shutdown()


# --- 1. streaming


@pytest.mark.parametrize("force", [{"ignore_eos": True}, {"min_tokens": 8}], ids=["ignore_eos", "min_tokens"])
async def test_stream_is_incremental_and_its_text_is_its_tokens(backend: Backend, force: dict[str, Any]) -> None:
    request = chat(SHORT, temperature=0, max_tokens=8, **force)
    result = await run(backend, request)
    assert len([d for d in result.deltas if d.token_ids]) > 1, "tokens must stream, not arrive at once"
    assert len(result.tokens) == 8
    assert result.last.finish_reason is FinishReason.LENGTH
    assert result.text == backend.decode(result.tokens)
    assert result.last.prompt_tokens == len(await backend.engine.tokenize(request)) > 0


# A greedy answer that repeats itself: a speculative proposer finds its drafts in the context.
REPEATING = "Repeat this sentence five times: the quick brown fox jumps over the lazy dog."


async def test_several_tokens_in_one_step_stream_as_their_text(backend: Backend) -> None:
    """With speculative decoding a step emits several tokens: one delta carries them, with their text."""
    if "ngram" not in backend.name:
        pytest.skip(f"the {backend.name} engine emits one token per step")
    result = await run(backend, chat(REPEATING, temperature=0, max_tokens=64, ignore_eos=True))
    assert len(result.tokens) == 64
    assert max(len(d.token_ids) for d in result.deltas) >= 2, [len(d.token_ids) for d in result.deltas]
    assert result.text == backend.decode(result.tokens)


# --- 2. max_tokens


@pytest.mark.parametrize("max_tokens", [1, 5])
async def test_max_tokens_ends_with_length_exactly_there(backend: Backend, max_tokens: int) -> None:
    result = await run(backend, chat(LONG, temperature=0, max_tokens=max_tokens))
    assert result.last.finish_reason is FinishReason.LENGTH
    assert len(result.tokens) == max_tokens
    assert result.text == backend.decode(result.tokens)


async def prompt_of(backend: Backend, n_tokens: int) -> GenerationRequest:
    """A chat request whose prompt is exactly ``n_tokens`` long on this engine."""
    words = n_tokens
    for _ in range(8):
        request = chat(" ".join(["sea"] * words), temperature=0, max_tokens=1_000_000, ignore_eos=True)
        have = len(await backend.engine.tokenize(request))
        if have == n_tokens:
            return request
        words += n_tokens - have
    raise AssertionError(f"no prompt of {n_tokens} tokens")


async def test_a_budget_past_the_models_length_ends_at_it(backend: Backend) -> None:
    """The gateway caps max_tokens; past that, an engine stops where the model's length does (LENGTH),
    as vLLM's engine does, rather than fail a request whose answer may well fit."""
    request = await prompt_of(backend, MAX_MODEL_LEN - 6)
    result = await run(backend, request)
    assert result.last.finish_reason is FinishReason.LENGTH
    assert result.last.prompt_tokens == MAX_MODEL_LEN - 6
    assert len(result.tokens) == 6


# --- 3. stop strings


def pick_stop(reference: Result, where: str) -> str:
    """A stop string from the reference answer: inside one delta's text, or the end of one delta's
    text and the start of the next (its first occurrence straddling that boundary)."""
    pieces = [d.text for d in reference.deltas]
    offset = len(pieces[0])
    for here, after in pairwise(pieces[1:]):
        start = offset
        offset += len(here)
        if where == "inside_a_token":
            word = here.strip()
            if len(word) >= 3 and word.isalnum():
                return word[1:]
        elif len(here.strip()) >= 2 and after.strip():
            stop = here[-2:] + after[:2]
            if reference.text.index(stop) == start + len(here) - 2:
                return stop
    raise AssertionError(f"no stop string {where} in {pieces!r}")


@pytest.mark.parametrize("where", ["inside_a_token", "across_tokens"])
async def test_stop_string_ends_the_stream_before_it(backend: Backend, reference: Result, where: str) -> None:
    stop = pick_stop(reference, where)
    request = chat(LONG, temperature=0, max_tokens=REFERENCE_TOKENS, ignore_eos=True, stop=(stop,))
    result = await run(backend, request)
    assert result.last.finish_reason is FinishReason.STOP_SEQUENCE
    assert stop not in result.text, (stop, result.text)
    assert result.text == reference.text[: reference.text.index(stop)], (stop, reference.text)


# --- 4. abort


async def test_abort_ends_the_stream_with_one_cancelled_delta(backend: Backend) -> None:
    request = chat(LONG, temperature=0, max_tokens=200, ignore_eos=True)
    stream = backend.engine.stream(request)
    first = await anext(stream)
    assert first.finish_reason is None and first.token_ids
    await backend.engine.abort(request.request_id)
    rest = await asyncio.wait_for(collect(stream), ABORT_WAIT_S)
    deltas = [first, *rest]
    assert [d.finish_reason for d in deltas].count(FinishReason.CANCELLED) == 1
    assert deltas[-1].finish_reason is FinishReason.CANCELLED and deltas[-1].prompt_tokens is not None
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert sum(len(d.token_ids) for d in deltas) < 200
    # A finished or unknown id is ignored.
    await backend.engine.abort(request.request_id)
    await backend.engine.abort(uuid.uuid4().hex)
    after = await run(backend, chat(SHORT, temperature=0, max_tokens=3, ignore_eos=True))
    assert after.last.finish_reason is FinishReason.LENGTH and len(after.tokens) == 3


# --- n parallel samples (through workers/samples.py: the engine's own parallel sampling, or one
# engine request per sample)


async def test_n_samples_each_end_once_and_an_abort_stops_them_all(backend: Backend) -> None:
    samples = Samples(backend.engine)
    request = chat(LONG, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=3)
    deltas = await collect(samples.stream(request))
    ends = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.sample for d in ends) == [0, 1, 2] and all(d.finish_reason is FinishReason.LENGTH for d in ends)
    assert all(d.prompt_tokens for d in ends) and deltas[-1] is ends[-1]
    per = {k: [t for d in deltas if d.sample == k for t in d.token_ids] for k in range(3)}
    assert all(len(v) == 6 for v in per.values())
    for k in range(3):  # each sample's text is its tokens
        assert "".join(d.text for d in deltas if d.sample == k) == backend.decode(per[k])
    long_one = chat(LONG, temperature=1.0, max_tokens=200, ignore_eos=True, n=2)
    stream = samples.stream(long_one)
    first = await anext(stream)
    assert first.finish_reason is None
    await samples.abort(long_one.request_id)
    rest = await asyncio.wait_for(collect(stream), ABORT_WAIT_S)
    assert [d.finish_reason for d in rest].count(FinishReason.CANCELLED) == 1
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert sum(len(d.token_ids) for d in [first, *rest]) < 400


# --- 5. determinism


async def test_the_same_seed_gives_the_same_sample(backend: Backend) -> None:
    first, second = [
        await run(backend, chat(LONG, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)) for _ in range(2)
    ]
    assert first.tokens == second.tokens
    assert first.text == second.text


async def test_greedy_is_repeatable(backend: Backend, reference: Result) -> None:
    again = await run(backend, chat(LONG, temperature=0, max_tokens=REFERENCE_TOKENS, ignore_eos=True))
    assert again.tokens == reference.tokens
    assert again.text == reference.text


# --- resuming (mid-stream failover: the gateway sends the tokens the caller already has)


async def test_a_resumed_request_goes_on_from_the_sent_tokens(backend: Backend, reference: Result) -> None:
    ends = [sum(len(d.token_ids) for d in reference.deltas[: i + 1]) for i in range(len(reference.deltas))]
    cut = next(i for i, n in enumerate(ends) if n >= 5)  # a delta boundary: the text sent so far is known
    k = ends[cut]
    request = chat(LONG, temperature=0, max_tokens=REFERENCE_TOKENS - k, ignore_eos=True)
    rest = await run(backend, replace(request, resume_token_ids=tuple(reference.tokens[:k])))
    assert rest.tokens == reference.tokens[k:]  # greedy: what the uninterrupted run gave
    assert "".join(d.text for d in reference.deltas[: cut + 1]) + rest.text == reference.text
    assert rest.last.prompt_tokens == reference.last.prompt_tokens  # the resumed tokens are not prompt
    assert rest.last.finish_reason is FinishReason.LENGTH


def boundary(whole: Result) -> tuple[int, str, str]:
    """A boundary between two deltas inside ``whole``'s text: the tokens before it, the last characters
    of the text before it and the first ones after it (their join occurs nowhere earlier)."""
    texts = [d.text for d in whole.deltas]
    for i in range(3, len(texts) - 1):
        before, after = "".join(texts[:i]), texts[i]
        tail, head = before[-3:], after[:2]
        if len(tail) == 3 and len(head) == 2 and tail.strip() and (tail + head) not in before + after[:1]:
            return sum(len(d.token_ids) for d in whole.deltas[:i]), tail, head
    raise AssertionError(f"no boundary in {texts}")


def text_through(result: Result, k: int) -> str:
    """The text a caller holding ``result``'s first ``k`` tokens has (whole deltas: a failover point)."""
    ends = [sum(len(d.token_ids) for d in result.deltas[: i + 1]) for i in range(len(result.deltas))]
    assert k in ends, (k, ends)
    return "".join(d.text for d in result.deltas[: ends.index(k) + 1])


def failover_text_known(backend: Backend) -> None:
    if engine_of(backend.name) == "trtllm":
        pytest.xfail("how TensorRT-LLM streams text near a stop string is not known (its adapter never ran)")


def resume(ask: GenerationRequest, whole: Result, k: int) -> GenerationRequest:
    """``ask`` resumed after the first ``k`` tokens of ``whole``."""
    sampling = replace(ask.sampling, max_tokens=ask.sampling.max_tokens - k)  # type: ignore[operator]
    return replace(ask, sampling=sampling, resume_token_ids=tuple(whole.tokens[:k]))


async def test_a_stop_string_across_the_failover_point_ends_the_resumed_run(
    backend: Backend, reference: Result
) -> None:
    failover_text_known(backend)
    k, tail, head = boundary(reference)
    ask = chat(LONG, temperature=0, max_tokens=REFERENCE_TOKENS, ignore_eos=True, stop=(tail + head,))
    stopped = await run(backend, ask)
    assert stopped.last.finish_reason is FinishReason.STOP_SEQUENCE and stopped.tokens[:k] == reference.tokens[:k]
    before = text_through(stopped, k)  # what the caller had: the stop string's beginning held back
    assert not before.endswith(tail)
    rest = await run(backend, resume(ask, reference, k))
    assert rest.last.finish_reason is FinishReason.STOP_SEQUENCE, rest.text
    assert rest.tokens == reference.tokens[k : k + len(rest.tokens)]
    assert before + rest.text == stopped.text


async def test_text_held_back_at_the_failover_point_comes_with_the_resumed_run(
    backend: Backend, reference: Result
) -> None:
    failover_text_known(backend)
    k, tail, _head = boundary(reference)
    never = tail + "\x00"  # begins as the text at the boundary ends, never completed
    ask = chat(LONG, temperature=0, max_tokens=REFERENCE_TOKENS, ignore_eos=True, stop=(never,))
    held = await run(backend, ask)
    assert held.text == reference.text and held.tokens == reference.tokens
    before = text_through(held, k)
    assert before + tail == text_through(reference, k)  # held back when the worker died
    rest = await run(backend, resume(ask, reference, k))
    assert rest.tokens == reference.tokens[k:] and rest.text.startswith(tail)
    assert before + rest.text == reference.text


# --- 6. bad sampling input


BAD_SAMPLING = [
    pytest.param({"temperature": -1.0}, "temperature", id="temperature=-1"),
    pytest.param({"top_p": 0.0}, "top_p", id="top_p=0"),
    pytest.param({"top_p": 1.5}, "top_p", id="top_p=1.5"),
    pytest.param({"top_k": -2}, "top_k", id="top_k=-2"),
    pytest.param({"max_tokens": 0}, "max_tokens", id="max_tokens=0"),
    pytest.param({"logprobs": 1000}, "logprobs", id="logprobs=1000"),
    pytest.param({"min_tokens": 5, "max_tokens": 2}, "min_tokens", id="min_tokens>max_tokens"),
    pytest.param({"stop_token_ids": (10_000_000,)}, "stop_token_ids", id="stop_token_id>vocab"),
]


@pytest.mark.parametrize(("sampling", "field"), BAD_SAMPLING)
async def test_bad_sampling_raises_invalid_request_naming_the_field(
    backend: Backend, sampling: dict[str, Any], field: str
) -> None:
    stream = backend.engine.stream(chat(SHORT, **{"temperature": 0, **sampling}))
    try:
        delta = await anext(stream)
    except InvalidRequest as exc:
        error = exc
    else:
        pytest.fail(f"{backend.name} accepted {sampling} and streamed {delta!r}")
    finally:
        if isinstance(stream, AsyncGenerator):  # closing it aborts the request in the engine
            await stream.aclose()
    assert field_of(error) == field, error
    after = await run(backend, chat(SHORT, temperature=0, max_tokens=2, ignore_eos=True))
    assert len(after.tokens) == 2


# --- 8. concurrency


async def test_concurrent_streams_each_get_their_own_length(backend: Backend) -> None:
    lengths = [3, 5, 7, 9]
    requests = [chat(q, temperature=0, max_tokens=n, ignore_eos=True) for q, n in zip(QUESTIONS, lengths, strict=True)]
    results = await asyncio.gather(*(run(backend, r) for r in requests))
    for request, n, result in zip(requests, lengths, results, strict=True):
        assert result.last.finish_reason is FinishReason.LENGTH
        assert len(result.tokens) == n
        assert result.text == backend.decode(result.tokens)
        assert result.last.prompt_tokens == len(await backend.engine.tokenize(request))
