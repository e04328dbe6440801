"""Property: no sampling value, however extreme, hurts anyone else. Straight into the engines (no
gateway in front: a job may reach a worker without one), the real CPU engine and the fake one, each
odd request next to a greedy canary: the odd one is refused (InvalidRequest naming one of its fields,
before any delta) or finishes properly; the canary gets exactly its tokens of a solo run; the engine
stays healthy."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamamesh.errors import InvalidRequest
from llamamesh.settings import WorkerSettings
from llamamesh.types import ChatMessage, GenerationRequest, SamplingParams, TokenDelta
from tests.sampling_strategies import EDGE_FLOATS, sampling_params
from workers.engines.base import Engine
from workers.engines.fake import FakeEngine

pytestmark = pytest.mark.timeout(300)

FIELDS = {f.name for f in fields(SamplingParams)}


@dataclass
class Started:
    engine: Engine
    loop: asyncio.AbstractEventLoop
    canary: GenerationRequest
    reference: list[int]


def request(params: SamplingParams, text: str = "What is the capital of France?") -> GenerationRequest:
    return GenerationRequest(uuid.uuid4().hex, "m", messages=(ChatMessage("user", text),), sampling=params)


async def tokens(engine: Engine, req: GenerationRequest) -> tuple[list[TokenDelta], BaseException | None]:
    got: list[TokenDelta] = []
    try:
        async for d in engine.stream(req):
            got.append(d)
    except Exception as exc:
        return got, exc
    return got, None


def started(engine: Engine) -> Iterator[Started]:
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    canary = request(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "Name three colours.")
    got, err = loop.run_until_complete(tokens(engine, canary))
    assert err is None
    try:
        yield Started(engine, loop, canary, [t for d in got for t in d.token_ids])
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


@pytest.fixture(scope="module")
def fake() -> Iterator[Started]:
    yield from started(FakeEngine(WorkerSettings(engine="fake", max_model_len=256)))


@pytest.fixture(scope="module")
def cpu() -> Iterator[Started]:
    from workers.engines.transformers import TransformersEngine

    # A context of 64 tokens: a request with no max_tokens (and ignore_eos) runs to it, 27 tokens
    # past the 37 of its prompt, not the ~220 (18 s) of a 256-token context.
    yield from started(TransformersEngine(WorkerSettings(max_inflight=4, max_model_len=64, threads=1)))


def check(s: Started, params: SamplingParams, with_canary: bool = True) -> None:
    async def both() -> list[tuple[list[TokenDelta], BaseException | None]]:
        canary = GenerationRequest(
            uuid.uuid4().hex, s.canary.model, messages=s.canary.messages, sampling=s.canary.sampling
        )
        runs = [tokens(s.engine, request(params)), *([tokens(s.engine, canary)] if with_canary else [])]
        return await asyncio.wait_for(asyncio.gather(*runs), 120)

    (odd, odd_err), *canaries = s.loop.run_until_complete(both())
    for canary, canary_err in canaries:
        assert canary_err is None, canary_err
        assert [t for d in canary for t in d.token_ids] == s.reference  # unaffected, to the bit
    if odd_err is not None:
        assert isinstance(odd_err, InvalidRequest), repr(odd_err)  # never INTERNAL, never EngineDead
        assert odd == [] and {v.field for v in odd_err.violations} <= FIELDS, odd_err.violations
    else:
        assert odd and odd[-1].finish_reason is not None, odd
        limit = params.max_tokens if params.max_tokens is not None else 10**6
        assert sum(len(d.token_ids) for d in odd) <= limit
    s.loop.run_until_complete(s.engine.check_health())


# Bounded budgets: a valid request runs at most 8 tokens (min_tokens beyond it is refused).
SMALL = st.integers(-2, 8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=sampling_params(SMALL))
def test_the_fake_engine_refuses_or_serves_any_sampling_values(fake: Started, params: SamplingParams) -> None:
    check(fake, params)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=sampling_params(SMALL))
def test_the_cpu_engine_refuses_or_serves_any_sampling_values(cpu: Started, params: SamplingParams) -> None:
    check(cpu, params)


@pytest.mark.parametrize("value", EDGE_FLOATS)
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
def test_every_edge_float_in_every_field_of_the_cpu_engine(cpu: Started, field: str, value: float) -> None:
    """The named values, each alone in each float field, sampling (seeded) so the value matters
    (the canary's company is the hypothesis tests' part)."""
    values: dict[str, object] = {"max_tokens": 2, "temperature": 1.0, "seed": 7, field: value}
    check(cpu, SamplingParams(**values), with_canary=False)  # type: ignore[arg-type]
