"""The CPU engine on the real SmolLM2-135M-Instruct (converted once into ~/.cache/llamamesh)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import pytest
import pytest_asyncio
import torch

from llamamesh.errors import EngineDead, InvalidRequest, PromptTooLong
from llamamesh.settings import WorkerSettings
from llamamesh.types import ChatMessage, FinishReason, GenerationRequest, JobKind, SamplingParams, TokenDelta
from workers.engines.transformers import TransformersEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

MAX_MODEL_LEN = 256
EOS = 2


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[TransformersEngine]:
    eng = TransformersEngine(WorkerSettings(max_inflight=8, max_model_len=MAX_MODEL_LEN))
    await eng.start()
    yield eng
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


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Bounded polling (the engine's state changes in its own thread's steps)."""

    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 - the state changes in the engine thread: bounded polling
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)  # asyncio.timeout is 3.11+; the code supports 3.10


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
    await until(lambda: engine.stats().running == 1)
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
    await until(lambda: engine.stats().running == 0)
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
    eng = TransformersEngine(WorkerSettings(max_inflight=1, max_model_len=MAX_MODEL_LEN))
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_abort_of_a_waiting_request(spare: TransformersEngine) -> None:
    running = chat(QUESTIONS[2], temperature=0, max_tokens=200, ignore_eos=True)
    waiting = chat(QUESTIONS[0], temperature=0, max_tokens=8)
    first = spare.stream(running)
    await anext(first)
    second = spare.stream(waiting)
    pending = asyncio.ensure_future(anext(second))
    await until(lambda: spare.stats().waiting == 1)
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
    await until(lambda: spare.stats().waiting == 1)
    tasks.append(asyncio.ensure_future(finish(high)))
    await until(lambda: spare.stats().waiting == 2)
    await spare.abort(blocker.request_id)
    [d async for d in first]
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert finished == [high.request_id, low.request_id]


@pytest_asyncio.fixture(loop_scope="module")
async def f32() -> AsyncIterator[TransformersEngine]:
    """float32: a resumed run prefills the sent tokens in one pass where the whole run decoded them
    one by one; in bf16 the two round differently and can part at a near-tie."""
    eng = TransformersEngine(WorkerSettings(max_inflight=4, max_model_len=MAX_MODEL_LEN, dtype="float32"))
    await eng.start()
    yield eng
    await eng.shutdown()


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
