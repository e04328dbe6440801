"""A resumed request's text on the CPU engine (the real SmolLM2-135M-Instruct) and the fake: text
the earlier attempt held back at the failover point, because it could begin a stop string, comes
with the resumed run's first tokens, and a stop string across the failover point ends the resumed
run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio

from llamamesh.settings import WorkerSettings
from llamamesh.types import FinishReason
from tests.workers.test_transformers_engine import QUESTIONS, Result, chat, run, started
from workers.engines.base import Engine
from workers.engines.fake import FakeEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

TOKENS = 24


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["transformers", "fake"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine]:
    """The CPU engine, and the fake one (whose resumed runs the chaos tests compare)."""
    if request.param == "fake":
        fake = FakeEngine(WorkerSettings())
        await fake.start()
        yield fake
        await fake.shutdown()
        return
    async for eng in started(max_inflight=4):
        yield eng


def boundary(whole: Result) -> tuple[int, int, str, str]:
    """A boundary between two deltas inside the text: how many deltas and tokens precede it, the last
    characters of the text before it and the first ones after it (their join occurs nowhere earlier)."""
    texts = [d.text for d in whole.deltas]
    for i in range(3, len(texts) - 1):
        before, after = "".join(texts[:i]), texts[i]
        tail, head = before[-3:], after[:2]
        if len(tail) == 3 and len(head) == 2 and tail.strip() and (tail + head) not in before + after[:1]:
            return i, sum(len(d.token_ids) for d in whole.deltas[:i]), tail, head
    raise AssertionError(f"no boundary in {texts}")


def text_of(result: Result, deltas: int) -> str:
    return "".join(d.text for d in result.deltas[:deltas])


async def test_a_stop_string_across_the_failover_point_ends_the_resumed_run(engine: Engine) -> None:
    ask = chat(QUESTIONS[2], temperature=0, max_tokens=TOKENS, ignore_eos=True)
    whole = await run(engine, ask)
    i, k, tail, head = boundary(whole)
    stopped = await run(engine, replace(ask, sampling=replace(ask.sampling, stop=(tail + head,))))
    assert stopped.last.finish_reason is FinishReason.STOP_SEQUENCE and stopped.tokens == whole.tokens[: k + 1]
    before = text_of(stopped, i)  # what the caller had: the tail held back
    assert not before.endswith(tail)
    rest = await run(engine, resume(ask, whole, k, stop=tail + head))
    assert rest.last.finish_reason is FinishReason.STOP_SEQUENCE and rest.tokens == whole.tokens[k : k + 1]
    assert before + rest.text == stopped.text


async def test_text_held_back_at_the_failover_point_comes_with_the_resumed_run(engine: Engine) -> None:
    ask = chat(QUESTIONS[2], temperature=0, max_tokens=TOKENS, ignore_eos=True)
    whole = await run(engine, ask)
    i, k, tail, _head = boundary(whole)
    never = tail + "\x00"  # begins as the text at the boundary ends, never completed
    held = await run(engine, replace(ask, sampling=replace(ask.sampling, stop=(never,))))
    assert held.text == whole.text and held.tokens == whole.tokens
    before = text_of(held, i)
    assert before + tail == text_of(whole, i)  # held back when the worker died
    rest = await run(engine, resume(ask, whole, k, stop=never))
    assert rest.tokens == whole.tokens[k:] and rest.text.startswith(tail)
    assert before + rest.text == whole.text


def resume(ask, whole: Result, k: int, stop: str):  # type: ignore[no-untyped-def]
    """``ask`` resumed after the first ``k`` tokens of ``whole``, with ``stop``."""
    sampling = replace(ask.sampling, max_tokens=TOKENS - k, stop=(stop,))
    return replace(ask, sampling=sampling, resume_token_ids=tuple(whole.tokens[:k]))
