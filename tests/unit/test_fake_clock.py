"""The fake engine's clock (workers/engines/fake.py): on the deadline clock a busy event loop delays
tokens but loses no steps; on the sleep clock its steps stretch, so it offers fewer tokens."""

from __future__ import annotations

import asyncio
import time

import pytest

from llamamesh.settings import WorkerSettings
from llamamesh.types import GenerationRequest, SamplingParams
from workers.engines.fake import FakeEngine

STEP_S = 0.01


async def tokens_by(clock: str, busy_s: float, window_s: float) -> tuple[int, int]:
    """Tokens one request got and steps the clock made within ``window_s`` of its start, the
    event loop blocked for ``busy_s`` after the first token."""
    engine = FakeEngine(WorkerSettings(engine="fake", fake_step_s=STEP_S, fake_clock=clock))
    await engine.start()
    loop = asyncio.get_running_loop()
    req = GenerationRequest(request_id="r", model="m", prompt="a b c", sampling=SamplingParams(max_tokens=1000))
    stream = engine.stream(req)
    try:
        t0 = loop.time()
        n = len((await anext(stream)).token_ids)
        time.sleep(busy_s)  # noqa: ASYNC251 - the point: a loop too busy to run the clock
        while loop.time() - t0 < window_s:
            n += len((await anext(stream)).token_ids)
        return n, engine.steps
    finally:
        await stream.aclose()
        await engine.shutdown()


async def test_deadline_clock_delivers_missed_steps() -> None:
    n, steps = await tokens_by("deadline", busy_s=0.1, window_s=0.2)
    # Steps keep their times: by 0.2 s about 20 were due, the ten the loop slept through included.
    assert steps >= int(0.2 / STEP_S) - 1
    assert n >= steps - 2  # the request got a token of every step since it started


async def test_sleep_clock_stretches_under_load() -> None:
    n, steps = await tokens_by("sleep", busy_s=0.1, window_s=0.2)
    # The blocked 0.1 s cost the sleep clock its steps: about 10 + 1, never the 20 that were due.
    assert steps <= int(0.2 / STEP_S) - 5
    assert n <= steps + 1


async def test_deadline_clock_without_load_is_one_token_a_step() -> None:
    engine = FakeEngine(WorkerSettings(engine="fake", fake_step_s=STEP_S))
    await engine.start()
    req = GenerationRequest(request_id="r", model="m", prompt="a b c", sampling=SamplingParams(max_tokens=5))
    try:
        deltas = [d async for d in engine.stream(req)]
    finally:
        await engine.shutdown()
    assert [len(d.token_ids) for d in deltas] == [1] * 5
    assert deltas[-1].finish_reason is not None


def test_unknown_clock_is_refused() -> None:
    with pytest.raises(ValueError, match="FAKE_CLOCK"):
        WorkerSettings(engine="fake", fake_clock="wall")


async def _time_to_finish(settings: WorkerSettings, prompts: list[str], tokens: int) -> tuple[float, float]:
    """Seconds to the first token and to the end of ``prompts`` run together."""
    engine = FakeEngine(settings)
    await engine.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first: list[float] = []

    async def one(i: int, prompt: str) -> None:
        req = GenerationRequest(
            request_id=f"r{i}", model="m", prompt=prompt, sampling=SamplingParams(max_tokens=tokens)
        )
        async for _ in engine.stream(req):
            first.append(loop.time() - t0)

    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return min(first), loop.time() - t0
    finally:
        await engine.shutdown()


async def test_a_costed_step_grows_with_the_requests_running_and_the_prompt_tokens_starting() -> None:
    costed = WorkerSettings(engine="fake", fake_step_s=0.01, fake_step_request_s=0.005, fake_step_prompt_token_s=0.002)
    _first, alone = await _time_to_finish(costed, ["a b"], 10)
    _first, four = await _time_to_finish(costed, ["a b"] * 4, 10)
    assert alone >= 9 * 0.015 and four >= 9 * 0.03  # each step: 10 ms + 5 ms a running request
    assert four > 1.5 * alone
    first, _end = await _time_to_finish(costed, [" ".join(["w"] * 100)], 2)
    assert first >= 0.01 + 0.005 + 100 * 0.002  # the first step prefills the 100-token prompt
