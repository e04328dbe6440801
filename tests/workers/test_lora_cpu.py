"""LoRA adapters on the CPU engine with the real SmolLM2-135M-Instruct (peft): an adapter the test
makes itself changes the greedy output, the same way each run, alone or batched with base-model
requests and another adapter's; adapters load and unload at run time; an unknown one is NOT_FOUND."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from llamamesh.errors import FailedPrecondition, NotFound
from llamamesh.settings import WorkerSettings
from llamamesh.types import ChatMessage, FinishReason, GenerationRequest, SamplingParams
from tests.adapters import make_adapter
from workers.engines.transformers import TransformersEngine
from workers.engines.transformers_model import convert_in_subprocess

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

ASK = "Name three colours."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = convert_in_subprocess(WorkerSettings().cache_dir)
    root = tmp_path_factory.mktemp("adapters")
    return make_adapter(folder, root / "a", seed=1), make_adapter(folder, root / "b", seed=2)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(adapters: tuple[Path, Path]) -> AsyncIterator[TransformersEngine]:
    eng = TransformersEngine(WorkerSettings(max_model_len=256, max_inflight=8, threads=1, adapters=f"a={adapters[0]}"))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def ask(adapter: str = "", rid: str = "") -> GenerationRequest:
    return GenerationRequest(
        request_id=rid or uuid.uuid4().hex,
        model="smollm2-135m-instruct",
        messages=(ChatMessage("user", ASK),),
        adapter=adapter,
        sampling=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    )


async def tokens(engine: TransformersEngine, request: GenerationRequest) -> list[int]:
    out = [d async for d in engine.stream(request)]
    assert out[-1].finish_reason is FinishReason.LENGTH
    return [t for d in out for t in d.token_ids]


async def test_an_adapter_changes_the_output_the_same_way_each_run(engine: TransformersEngine) -> None:
    assert engine.adapters == ("a",)
    base = await tokens(engine, ask())
    with_a = await tokens(engine, ask("a"))
    assert with_a != base
    assert await tokens(engine, ask("a")) == with_a
    assert await tokens(engine, ask()) == base  # the base model is untouched by the adapter


async def test_base_and_adapter_requests_batched_together_give_what_they_give_alone(
    engine: TransformersEngine, adapters: tuple[Path, Path]
) -> None:
    await engine.load_adapter("b", str(adapters[1]))
    assert engine.adapters == ("a", "b")
    alone = {name: await tokens(engine, ask(name)) for name in ("", "a", "b")}
    assert len({tuple(v) for v in alone.values()}) == 3
    together = await asyncio.gather(*(tokens(engine, ask(name)) for name in ("", "a", "b", "a", "")))
    assert together == [alone[""], alone["a"], alone["b"], alone["a"], alone[""]]


async def test_unknown_adapters_are_not_found_and_unload_waits_for_its_requests(
    engine: TransformersEngine, adapters: tuple[Path, Path]
) -> None:
    with pytest.raises(NotFound):
        await tokens(engine, ask("nope"))
    with pytest.raises(NotFound):
        await engine.load_adapter("c", str(adapters[0].parent / "no-such-folder"))
    await engine.load_adapter("b", str(adapters[1]))  # loaded already: nothing to do
    long = dataclasses.replace(ask("b"), sampling=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    stream = engine.stream(long)
    first = await anext(stream)
    assert first.token_ids
    with pytest.raises(FailedPrecondition):
        await engine.unload_adapter("b")  # a request still uses it
    await engine.abort(long.request_id)
    assert [d async for d in stream][-1].finish_reason is FinishReason.CANCELLED
    with_a = await tokens(engine, ask("a"))
    await engine.unload_adapter("b")
    assert engine.adapters == ("a",)
    with pytest.raises(NotFound):
        await tokens(engine, ask("b"))
    assert await tokens(engine, ask("a")) == with_a  # the others stay as they were
    base = await tokens(engine, ask())
    await engine.unload_adapter("a")  # the last one
    assert engine.adapters == ()
    assert await tokens(engine, ask()) == base
    with pytest.raises(NotFound):
        await tokens(engine, ask("a"))
