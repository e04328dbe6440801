"""The CPU engine on the real SmolLM2-135M-Instruct (converted once into ~/.cache/llamamesh)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from llamamesh.errors import EngineDead, InternalError, InvalidRequest, PromptTooLong
from llamamesh.settings import WorkerSettings
from llamamesh.types import ChatMessage, FinishReason, GenerationRequest, JobKind, SamplingParams, TokenDelta
from tests.waiting import until
from workers.engines.transformers import TransformersEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

MAX_MODEL_LEN = 256
EOS = 2


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[TransformersEngine]:
    async for eng in started(max_inflight=8):
        yield eng


async def started(**settings: object) -> AsyncIterator[TransformersEngine]:
    """An engine of its own with these WorkerSettings (and the module's max_model_len), shut down after."""
    eng = TransformersEngine(WorkerSettings(max_model_len=MAX_MODEL_LEN, **settings))  # type: ignore[arg-type]
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def chat(question: str, **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        model="smollm2-135m-instruct",
        messages=(ChatMessage("user", question),),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def prompt(text: str, **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        model="smollm2-135m-instruct",
        prompt=text,
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


@dataclass
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


async def run(engine: TransformersEngine, request: GenerationRequest) -> Result:
    deltas = [d async for d in engine.stream(request)]
    assert all(d.finish_reason is None and d.prompt_tokens is None for d in deltas[:-1])
    # Only the flush at the very end may hold an incomplete character (as decode() shows it).
    assert all("\ufffd" not in d.text for d in deltas[:-1])
    assert deltas[-1].finish_reason is not None and deltas[-1].prompt_tokens is not None
    return Result(deltas)


async def collect(stream: AsyncIterator[TokenDelta], into: list[TokenDelta]) -> None:
    async for delta in stream:
        into.append(delta)


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "Name three colours.",
]


@pytest.mark.timeout(240)  # the first run converts the GGUF (about 40 s on 2 cores)
async def test_chat_prompt_gives_coherent_english(engine: TransformersEngine) -> None:
    request = chat("What is the capital of France?", temperature=0, max_tokens=24)
    result = await run(engine, request)
    assert "Paris" in result.text
    assert result.last.finish_reason is FinishReason.STOP
    assert result.tokens[-1] == EOS
    assert result.last.prompt_tokens == len(await engine.tokenize(request))
    assert result.text == engine.tokenizer.decode(result.tokens, skip_special_tokens=True)


async def test_multibyte_characters_are_never_split(engine: TransformersEngine) -> None:
    result = await run(engine, chat("Say hello in Chinese characters.", temperature=0, max_tokens=12))
    assert any(ord(c) > 0x2E80 for c in result.text)
    assert result.text == engine.tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert any(d.text == "" for d in result.deltas)


async def test_greedy_is_repeatable_and_matches_model_generate(engine: TransformersEngine) -> None:
    request = chat(QUESTIONS[1], temperature=0, max_tokens=20)
    first = await run(engine, request)
    second = await run(engine, chat(QUESTIONS[1], temperature=0, max_tokens=20))
    assert first.tokens == second.tokens and first.text == second.text
    ids = await engine.tokenize(request)

    def generate() -> list[int]:
        with torch.inference_mode():
            out = engine.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
            )
        return list(out[0, len(ids) :].tolist())

    # The engine is idle between requests, so running the model from another thread is safe here.
    assert await asyncio.to_thread(generate) == first.tokens


async def test_concurrent_requests_share_steps_and_match_their_solo_output(engine: TransformersEngine) -> None:
    solo = [await run(engine, chat(q, temperature=0, max_tokens=16)) for q in QUESTIONS]
    engine.max_batch_size = 0
    together = await asyncio.gather(*(run(engine, chat(q, temperature=0, max_tokens=16)) for q in QUESTIONS))
    assert engine.max_batch_size == len(QUESTIONS)
    for alone, batched in zip(solo, together, strict=True):
        assert batched.tokens == alone.tokens
        assert batched.text == alone.text


async def test_late_arrivals_join_a_running_batch_without_changing_it(engine: TransformersEngine) -> None:
    reference = await run(engine, chat(QUESTIONS[2], temperature=0, max_tokens=24))
    early = asyncio.ensure_future(run(engine, chat(QUESTIONS[2], temperature=0, max_tokens=24)))
    await until(lambda: engine.stats().running == 1, 10, "one request running")
    engine.max_batch_size = 0
    late = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=8))
    assert (await early).tokens == reference.tokens
    assert engine.max_batch_size == 2
    assert late.text


async def test_stop_string_ends_the_text_before_it(engine: TransformersEngine) -> None:
    full = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=24))
    assert "France is" in full.text
    result = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=24, stop=("ce is", "zzz")))
    assert result.last.finish_reason is FinishReason.STOP_SEQUENCE
    assert result.text == full.text[: full.text.index("ce is")]


async def test_stop_token_ids_end_the_stream_without_their_text(engine: TransformersEngine) -> None:
    full = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=24))
    stop_at = next(i for i in range(2, len(full.tokens)) if full.tokens[i] not in full.tokens[:i])
    stop_id = full.tokens[stop_at]
    result = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=24, stop_token_ids=(stop_id,)))
    assert result.last.finish_reason is FinishReason.STOP
    assert result.tokens == full.tokens[: stop_at + 1]
    assert result.text == engine.tokenizer.decode(full.tokens[:stop_at], skip_special_tokens=True)


async def test_max_tokens_gives_length_with_exactly_that_many_tokens(engine: TransformersEngine) -> None:
    result = await run(engine, chat(QUESTIONS[1], temperature=0, max_tokens=7))
    assert result.last.finish_reason is FinishReason.LENGTH
    assert len(result.tokens) == 7


async def test_prompt_and_completion_stop_at_max_model_len(engine: TransformersEngine) -> None:
    text = "one two three four five six seven " * 36
    n_prompt = len(await engine.tokenize(prompt(text)))
    assert MAX_MODEL_LEN - 16 < n_prompt < MAX_MODEL_LEN
    result = await run(engine, prompt(text, temperature=0, max_tokens=50, ignore_eos=True))
    assert result.last.finish_reason is FinishReason.LENGTH
    assert n_prompt + len(result.tokens) == MAX_MODEL_LEN


async def test_min_tokens_holds_off_eos(engine: TransformersEngine) -> None:
    short = await run(engine, chat("What is 2+2?", temperature=0, max_tokens=40))
    assert short.last.finish_reason is FinishReason.STOP
    n = len(short.tokens)
    result = await run(engine, chat("What is 2+2?", temperature=0, max_tokens=n + 12, min_tokens=n + 4))
    assert len(result.tokens) >= n + 4
    assert EOS not in result.tokens[: n + 3]


async def test_ignore_eos_runs_to_max_tokens(engine: TransformersEngine) -> None:
    result = await run(engine, chat("What is 2+2?", temperature=0, max_tokens=24, ignore_eos=True))
    assert result.last.finish_reason is FinishReason.LENGTH
    assert len(result.tokens) == 24


async def test_a_seed_fixes_the_sample_even_when_batched(engine: TransformersEngine) -> None:
    def seeded(seed: int) -> GenerationRequest:
        return chat("Tell me a story.", temperature=1.0, max_tokens=16, seed=seed)

    alone = await run(engine, seeded(42))
    batched, _other = await asyncio.gather(
        run(engine, seeded(42)), run(engine, chat(QUESTIONS[3], temperature=1.0, max_tokens=12))
    )
    assert batched.tokens == alone.tokens
    assert batched.text == alone.text


async def test_logprobs_come_with_each_token(engine: TransformersEngine) -> None:
    result = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=8, logprobs=3))
    for delta in result.deltas:
        assert len(delta.logprobs) == len(delta.token_ids)
        for token, lp in zip(delta.token_ids, delta.logprobs, strict=True):
            assert lp.token_id == token
            assert lp.logprob <= 0.0
            assert len(lp.top) == 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            # Greedy: the sampled token is the most likely one.
            assert lp.top[0].token_id == token and lp.top[0].logprob == pytest.approx(lp.logprob)
    none = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=4, logprobs=0))
    assert all(len(lp.top) == 0 for d in none.deltas for lp in d.logprobs)
    assert sum(len(d.logprobs) for d in none.deltas) == len(none.tokens)


async def test_abort_mid_stream_frees_the_slot(engine: TransformersEngine) -> None:
    request = chat(QUESTIONS[2], temperature=0, max_tokens=200, ignore_eos=True)
    deltas = []
    async for delta in engine.stream(request):
        deltas.append(delta)
        if len(deltas) == 2:
            await engine.abort(request.request_id)
    assert deltas[-1].finish_reason is FinishReason.CANCELLED
    assert sum(len(d.token_ids) for d in deltas) < 200
    assert request.request_id in engine.aborted
    assert engine.stats().running == 0


async def test_cancelling_the_consumer_aborts_the_request(engine: TransformersEngine) -> None:
    request = chat(QUESTIONS[2], temperature=0, max_tokens=200, ignore_eos=True)
    got_one = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.stream(request):
            got_one.set()

    task = asyncio.ensure_future(consume())
    await got_one.wait()
    assert engine.stats().running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert request.request_id in engine.aborted
    await until(lambda: engine.stats().running == 0, 10, "no request running")
    after = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=4))
    assert after.tokens


@pytest.mark.parametrize(
    ("sampling", "field"),
    [({"logprobs": 50}, "logprobs"), ({"stop_token_ids": (10**6,)}, "stop_token_ids"), ({"top_p": 0.0}, "top_p")],
)
async def test_bad_sampling_raises_invalid_request_naming_the_field(
    engine: TransformersEngine, sampling: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        await run(engine, chat(QUESTIONS[0], **sampling))
    assert info.value.violations[0].field == field


@pytest.mark.parametrize(("make", "field"), [(prompt, "prompt"), (chat, "messages")])
async def test_a_prompt_too_long_raises_before_any_delta(
    engine: TransformersEngine, make: Callable[..., GenerationRequest], field: str
) -> None:
    deltas: list[TokenDelta] = []
    with pytest.raises(PromptTooLong) as info:
        await collect(engine.stream(make("word " * (MAX_MODEL_LEN + 10), max_tokens=4)), deltas)
    assert deltas == []
    assert info.value.violations[0].field == field
    assert str(MAX_MODEL_LEN - 1) in info.value.message


async def test_a_prompt_of_megabytes_is_refused_without_tokenising_it(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenising 3 MB of text takes seconds on the engine's step thread, stalling every stream: a
    prompt more characters long than the context's tokens can hold is refused before that."""
    tok = engine.tokenizer
    encoded: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: (encoded.append(len(text)), real(text, **kw))[1])
    with pytest.raises(PromptTooLong) as info:
        await collect(engine.stream(prompt("語" * 1_000_000, max_tokens=4)), [])
    assert info.value.violations[0].field == "prompt" and "1000000 characters" in info.value.message
    assert str(MAX_MODEL_LEN - 1) in info.value.message and encoded == []
    assert (await run(engine, prompt("Hi", max_tokens=2))).deltas[-1].finish_reason is not None


async def test_tokenize_matches_the_tokenizer(engine: TransformersEngine) -> None:
    tok = engine.tokenizer
    assert await engine.tokenize(prompt("Hello world, 日本語 🙂")) == tok.encode("Hello world, 日本語 🙂")
    expected = tok.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert await engine.tokenize(chat(QUESTIONS[0])) == list(expected)
    tokenize_job = GenerationRequest(request_id="t", model="m", prompt="hi", kind=JobKind.TOKENIZE)
    with pytest.raises(InvalidRequest):
        await run(engine, tokenize_job)


async def test_stats_and_health(engine: TransformersEngine) -> None:
    await engine.check_health()
    assert engine.model_name == "smollm2-135m-instruct"
    request = chat(QUESTIONS[2], temperature=0, max_tokens=100, ignore_eos=True)
    stream = engine.stream(request)
    await anext(stream)
    stats = engine.stats()
    assert stats.running == 1 and stats.waiting == 0
    assert 0.0 < stats.kv_cache_usage < 0.1
    await engine.abort(request.request_id)
    assert [d async for d in stream][-1].finish_reason is FinishReason.CANCELLED
    assert engine.stats().kv_cache_usage == 0.0


# --- failures, on engines of their own


@pytest_asyncio.fixture(loop_scope="module")
async def spare() -> AsyncIterator[TransformersEngine]:
    """One request in flight at most, so that a second one waits."""
    async for eng in started(max_inflight=1):
        yield eng


async def test_abort_of_a_waiting_request(spare: TransformersEngine) -> None:
    running = chat(QUESTIONS[2], temperature=0, max_tokens=200, ignore_eos=True)
    waiting = chat(QUESTIONS[0], temperature=0, max_tokens=8)
    first = spare.stream(running)
    await anext(first)
    second = spare.stream(waiting)
    pending = asyncio.ensure_future(anext(second))
    await until(lambda: spare.stats().waiting == 1, 10, "one request waiting")
    assert spare.stats().running == 1
    await spare.abort(waiting.request_id)
    cancelled = await pending
    assert cancelled.finish_reason is FinishReason.CANCELLED and cancelled.token_ids == ()
    assert spare.stats().waiting == 0 and spare.stats().running == 1
    await spare.abort(running.request_id)
    assert [d async for d in first][-1].finish_reason is FinishReason.CANCELLED
    assert spare.aborted == [waiting.request_id, running.request_id]
    assert spare.stats().running == 0


async def test_a_failing_step_kills_the_engine_and_fails_its_requests(spare: TransformersEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in spare.stream(chat(QUESTIONS[0], temperature=0, max_tokens=100, ignore_eos=True)):
            started.set()

    task = asyncio.ensure_future(consume())
    await started.wait()

    def broken(*args: object) -> None:
        raise RuntimeError("simulated failure")

    spare._batch.step = broken  # type: ignore[method-assign,union-attr]
    with pytest.raises(EngineDead):
        await task
    with pytest.raises(EngineDead):
        await spare.check_health()
    with pytest.raises(EngineDead):
        await run(spare, chat(QUESTIONS[0], max_tokens=2))


async def test_shutdown_ends_pending_streams(spare: TransformersEngine) -> None:
    stream = spare.stream(chat(QUESTIONS[0], temperature=0, max_tokens=100, ignore_eos=True))
    await anext(stream)
    await spare.shutdown()
    with pytest.raises(EngineDead):
        async for _ in stream:
            pass
    with pytest.raises(EngineDead):
        await spare.check_health()


async def test_a_missing_model_path_raises_engine_dead() -> None:
    eng = TransformersEngine(WorkerSettings(model_path="/nonexistent/model.gguf"))
    with pytest.raises(EngineDead):
        await eng.start()
    await eng.shutdown()


async def test_waiting_requests_are_admitted_by_priority(spare: TransformersEngine) -> None:
    blocker = chat(QUESTIONS[2], temperature=0, max_tokens=200, ignore_eos=True)
    first = spare.stream(blocker)
    await anext(first)
    finished: list[str] = []

    async def finish(req: GenerationRequest) -> None:
        await run(spare, req)
        finished.append(req.request_id)

    low = replace(chat(QUESTIONS[0], temperature=0, max_tokens=2), priority=0)
    high = replace(chat(QUESTIONS[1], temperature=0, max_tokens=2), priority=5)
    tasks = [asyncio.ensure_future(finish(low))]
    await until(lambda: spare.stats().waiting == 1, 10, "one request waiting")
    tasks.append(asyncio.ensure_future(finish(high)))
    await until(lambda: spare.stats().waiting == 2, 10, "two requests waiting")
    await spare.abort(blocker.request_id)
    [d async for d in first]
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert finished == [high.request_id, low.request_id]


@pytest_asyncio.fixture(loop_scope="module")
async def f32() -> AsyncIterator[TransformersEngine]:
    """float32 (the replayed resume is exact in bf16 too: see below)."""
    async for eng in started(max_inflight=4, dtype="float32"):
        yield eng


@pytest_asyncio.fixture(loop_scope="module")
async def prefilled() -> AsyncIterator[TransformersEngine]:
    """Resumed tokens prefilled in one pass, as past LLAMAMESH_WORKER_RESUME_REPLAY_TOKENS."""
    async for eng in started(max_inflight=4, resume_replay_tokens=0):
        yield eng


async def test_a_resumed_request_goes_on_exactly_where_it_stopped(f32: TransformersEngine) -> None:
    """Mid-stream failover: prompt + the tokens already sent, the rest of the budget."""
    whole = await run(f32, chat(QUESTIONS[1], temperature=0, max_tokens=24, ignore_eos=True))
    assert len(whole.tokens) == 24
    ends = [sum(len(d.token_ids) for d in whole.deltas[: i + 1]) for i in range(len(whole.deltas))]
    for cut in (0, next(i for i, n in enumerate(ends) if n >= 9)):  # after one delta, and after ~9 tokens
        k = ends[cut]
        sent = whole.tokens[:k]
        request = chat(QUESTIONS[1], temperature=0, max_tokens=24 - k, ignore_eos=True)
        rest = await run(f32, replace(request, resume_token_ids=tuple(sent)))
        assert rest.tokens == whole.tokens[k:]
        # its text picks up where the text sent with those tokens ended: no repeat, no gap
        assert "".join(d.text for d in whole.deltas[: cut + 1]) + rest.text == whole.text
        assert rest.last.prompt_tokens == whole.last.prompt_tokens  # the resumed tokens are not prompt


async def test_a_resume_past_the_replay_bound_is_prefilled_and_its_text_joins(prefilled: TransformersEngine) -> None:
    """Prefill and decode kernels round differently, so a prefilled resume is a greedy continuation of
    prompt + sent tokens, not necessarily the uninterrupted one's: what is guaranteed is the budget,
    the joined text (no repeat, no gap) and the prompt count."""
    whole = await run(prefilled, chat(QUESTIONS[1], temperature=0, max_tokens=24, ignore_eos=True))
    sent, k = whole.tokens[:9], 9
    request = chat(QUESTIONS[1], temperature=0, max_tokens=24 - k, ignore_eos=True)
    rest = await run(prefilled, replace(request, resume_token_ids=tuple(sent)))
    assert len(rest.tokens) == 24 - k
    tok = prefilled.tokenizer
    assert tok.decode(sent, skip_special_tokens=True) + rest.text == tok.decode(
        sent + rest.tokens, skip_special_tokens=True
    )
    assert rest.last.prompt_tokens == whole.last.prompt_tokens


# --- batch invariance, bit for bit, and what one bad request may not do to the others


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def wide() -> AsyncIterator[TransformersEngine]:
    """Room for 20 in flight: more than one decode row group (16) at once."""
    async for eng in started(max_inflight=20):
        yield eng


def traced(question: str, n: int = 12, **sampling: object) -> GenerationRequest:
    """Greedy with logprobs: the logprob of each token is a float of the raw logits, so equal lists
    mean equal logits, not merely the same argmax."""
    return chat(question, temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, **sampling)


def trace(result: Result) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for d in result.deltas for lp in d.logprobs]


async def test_a_sequence_decodes_to_the_same_bits_alone_and_in_any_batch(wide: TransformersEngine) -> None:
    """Alone; with 16 others from the start (17 rows: two row groups); and with others that join
    after its third token and leave at different times (batch sizes 1 -> 9 -> 1 while it runs)."""
    alone = trace(await run(wide, traced(QUESTIONS[2])))
    crowd = [traced(QUESTIONS[i % 4] + " " * (i // 4), n=4 + i % 9) for i in range(16)]
    together = await asyncio.gather(run(wide, traced(QUESTIONS[2])), *(run(wide, r) for r in crowd))
    assert wide.max_batch_size == 17
    assert trace(together[0]) == alone

    wide.max_batch_size = 0
    early = asyncio.ensure_future(run(wide, traced(QUESTIONS[2])))
    await until(lambda: wide.steps > 0 and wide.stats().running == 1, 10, "the first step of one request")
    steps = wide.steps
    await until(lambda: wide.steps >= steps + 2, 10, "two steps more")
    late = await asyncio.gather(*(run(wide, traced(QUESTIONS[i % 4], n=2 + i)) for i in range(8)))
    assert all(len(r.tokens) == 2 + i for i, r in enumerate(late))
    assert wide.max_batch_size == 9
    assert trace(await early) == alone


async def test_a_temperature_below_epsilon_is_greedy(engine: TransformersEngine) -> None:
    """1e-40 is a subnormal float32: dividing logits by it overflows; it is taken as 0 (as vLLM does)."""
    greedy = await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=8))
    for tiny in (1e-40, 1e-45, 9e-6, -0.0):
        assert (await run(engine, chat(QUESTIONS[0], temperature=tiny, max_tokens=8))).tokens == greedy.tokens


async def test_overflowing_penalties_and_temperatures_do_not_break_the_sample(engine: TransformersEngine) -> None:
    """A repetition penalty of 1e-40 sends seen logits to +inf; a huge temperature flattens the
    distribution; both are sampled from without NaN, next to a greedy request that is unaffected."""
    canary = chat(QUESTIONS[1], temperature=0, max_tokens=10, ignore_eos=True)
    reference = await run(engine, canary)
    odd = [
        chat(QUESTIONS[0], temperature=1.0, repetition_penalty=1e-40, max_tokens=6, seed=1),
        chat(QUESTIONS[0], temperature=0, repetition_penalty=1e-40, max_tokens=6),
        chat(QUESTIONS[0], temperature=3.4028235e38, max_tokens=6, seed=2, min_tokens=6),
        chat(QUESTIONS[0], temperature=5e-3, top_p=1e-40, max_tokens=6, seed=3),
    ]
    again = replace(canary, request_id=uuid.uuid4().hex)
    results = await asyncio.gather(run(engine, again), *(run(engine, r) for r in odd))
    assert results[0].tokens == reference.tokens
    for r in results[1:]:
        assert r.last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and r.tokens
    await engine.check_health()


async def test_a_request_whose_sample_fails_fails_alone(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong in one request's sample (here: an injected error for seed 666) ends that
    request with INTERNAL; the batch it shared a step with goes on, to the same tokens as alone."""
    from workers.engines import sampling

    real = sampling.SequenceSampler.choose

    def choose(self: sampling.SequenceSampler, logits: torch.Tensor) -> int:
        if self.params.seed == 666 and self.generated >= 2:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(self, logits)

    monkeypatch.setattr(sampling.SequenceSampler, "choose", choose)
    canary = chat(QUESTIONS[2], temperature=0, max_tokens=12, ignore_eos=True)
    reference = await run(engine, canary)
    poison = chat(QUESTIONS[0], temperature=1.0, max_tokens=12, seed=666, ignore_eos=True)
    got: list[TokenDelta] = []
    outcome = await asyncio.gather(
        run(engine, replace(canary, request_id=uuid.uuid4().hex)),
        collect(engine.stream(poison), got),
        return_exceptions=True,
    )
    assert isinstance(outcome[1], InternalError) and "sample" in outcome[1].message
    assert len([t for d in got for t in d.token_ids]) == 2  # it streamed, then failed alone
    assert isinstance(outcome[0], Result) and outcome[0].tokens == reference.tokens
    await engine.check_health()
    assert (await run(engine, chat(QUESTIONS[0], temperature=0, max_tokens=3))).tokens


async def test_a_request_whose_prefill_fails_fails_alone(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.engines.transformers_batch import Batch

    real = Batch.encode

    def encode(self: Batch, request: GenerationRequest) -> list[int]:
        if request.prompt == "explode":
            raise UnicodeError("a tokenizer that chokes on this input")
        return real(self, request)

    monkeypatch.setattr(Batch, "encode", encode)
    running = asyncio.ensure_future(run(engine, chat(QUESTIONS[1], temperature=0, max_tokens=16, ignore_eos=True)))
    await until(lambda: engine.stats().running >= 1, 10, "a request running")
    with pytest.raises(InternalError):
        await run(engine, prompt("explode", max_tokens=4))
    assert len((await running).tokens) == 16
    await engine.check_health()


async def test_a_resumed_request_replays_its_tokens_to_the_same_bits_in_bf16(engine: TransformersEngine) -> None:
    """Failover on the CPU engine: the tokens an earlier attempt sent are fed back through decode
    steps (as the uninterrupted run computed them), so the rest is the same, in bfloat16, logprobs
    included; replaying ``k`` tokens takes ``k`` steps of that request."""
    whole = await run(engine, traced(QUESTIONS[3], n=20))
    for k in (1, 7, 13):
        sent = whole.tokens[:k]
        rest = await run(engine, replace(traced(QUESTIONS[3], n=20 - k), resume_token_ids=tuple(sent)))
        assert trace(rest) == trace(whole)[k:]
        assert rest.last.prompt_tokens == whole.last.prompt_tokens


async def test_resumed_token_ids_outside_the_vocabulary_are_refused(engine: TransformersEngine) -> None:
    with pytest.raises(InvalidRequest) as info:
        await run(engine, replace(chat(QUESTIONS[0], max_tokens=4), resume_token_ids=(5, 10**7)))
    assert info.value.violations[0].field == "resume_token_ids"


# Kernel paths other than this machine's own: what each caps, by the variables the libraries read at start.
ISA_CAPS = {
    "onednn-avx512-no-bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
}


@pytest.mark.timeout(400)
async def test_the_invariance_holds_on_other_x86_kernel_paths(repo_root: Path) -> None:
    """The same bit-for-bit tests with oneDNN capped at AVX-512 without BF16 (a Skylake/Cascade Lake
    Xeon's kernels) and ATen at AVX2: on these paths the libraries' GEMM rounding depends on the batch
    size (without the fixed-shape row groups the late-arrival test fails here). A cap above what the
    CPU has changes nothing, so this holds on any x86 machine the tests run on. Each path is a process
    of its own (the caps are read at start), both at once."""
    here = "tests/workers/test_transformers_engine.py::"
    tests = [
        here + name
        for name in (
            "test_a_sequence_decodes_to_the_same_bits_alone_and_in_any_batch",
            "test_a_resumed_request_replays_its_tokens_to_the_same_bits_in_bf16",
            "test_late_arrivals_join_a_running_batch_without_changing_it",
        )
    ]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]

    def run(caps: dict[str, str]) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **caps}
        return subprocess.run(argv, cwd=repo_root, env=env, capture_output=True, text=True, timeout=380)

    outs = await asyncio.gather(*(asyncio.to_thread(run, caps) for caps in ISA_CAPS.values()))
    for path, out in zip(ISA_CAPS, outs, strict=True):
        assert out.returncode == 0, (path, out.stdout[-3000:] + out.stderr[-2000:])
        assert "3 passed" in out.stdout, path
