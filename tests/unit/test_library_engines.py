"""What both GPU adapters owe through their shared skeleton (workers/engines/adapter.py
``LibraryEngine``), asserted once for each over its fake library: vLLM's ``AsyncLLM`` (DELTA outputs,
aborts on its own when its generator is closed) and TensorRT-LLM's ``LLM`` (cumulative outputs, never
aborts on its own). The mapping of each library's own arguments, errors and outputs stays in
test_vllm_mapping.py and test_trtllm_mapping.py; the pure shared functions are in
test_adapter_mapping.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

import pytest

from llamamesh.errors import EngineDead, InvalidRequest
from llamamesh.settings import TrtllmSettings, VllmSettings
from llamamesh.types import FinishReason, GenerationRequest, TokenDelta
from tests.unit import test_trtllm_mapping as T
from tests.unit import test_vllm_mapping as V
from tests.unit.test_trtllm_mapping import trt  # noqa: F401 - the fixture that fakes tensorrt_llm
from tests.waiting import until
from workers.engines.adapter import LibraryEngine
from workers.engines.base import EngineStats
from workers.engines.constraints import trtllm_guided, vllm_structured
from workers.engines.trtllm import TrtllmEngine
from workers.engines.vllm import VllmEngine

pytestmark = pytest.mark.timeout(10)

RID = "r1"


class Library(Protocol):
    """One library's fake as the tests drive it, for request ``RID``."""

    engine: LibraryEngine

    def knows(self) -> bool:
        """The library has the request."""
        ...

    def say(self, text: str, ids: tuple[int, ...], finish: str | None = None) -> None:
        """The library's next output for it: these new tokens (and its end)."""

    def stops(self) -> int:
        """How many times the library was told to stop it (by the adapter, or by its own handler)."""
        ...

    def adapter_stops(self) -> int:
        """How many of those came from the adapter's abort call."""
        ...

    # vLLM's generate() aborts the request itself when it is closed early; TensorRT-LLM's result does not.
    closes_itself: bool

    def shut_down(self) -> bool: ...

    def block_tokenizer(self, entered: threading.Event, release: threading.Event) -> None:
        """Tokenising waits for ``release`` (after setting ``entered``)."""


class VllmLib:
    closes_itself = True

    def __init__(self) -> None:
        self.llm = V.FakeAsyncLLM()
        self.engine = V.started(self.llm)

    def knows(self) -> bool:
        return RID in self.llm.queues

    def say(self, text: str, ids: tuple[int, ...], finish: str | None = None) -> None:
        self.llm.emit(RID, V.output(text, ids, finish=finish, prompt_ids=[1, 101]))

    def stops(self) -> int:
        return self.llm.internal_aborts.count(RID) + self.adapter_stops()

    def adapter_stops(self) -> int:
        return sum(c.count(RID) for c in self.llm.abort_calls)

    def shut_down(self) -> bool:
        return self.llm.shut_down

    def block_tokenizer(self, entered: threading.Event, release: threading.Event) -> None:
        class Slow(V.StubTokenizer):
            def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
                entered.set()
                release.wait(5)
                return super().encode(text, add_special_tokens)

        self.engine._tokenizer = Slow()


class TrtLib:
    closes_itself = False

    def __init__(self, engine: TrtllmEngine) -> None:
        self.engine = engine
        self.llm: T.FakeLLM = engine._llm

    def knows(self) -> bool:
        return bool(self.llm.results)

    def say(self, text: str, ids: tuple[int, ...], finish: str | None = None) -> None:
        self.llm.results[0].respond(text, ids, **({"finish": finish} if finish else {}))

    def stops(self) -> int:
        return sum(r.abort_calls for r in self.llm.results)

    def adapter_stops(self) -> int:
        return self.stops()

    def shut_down(self) -> bool:
        return self.llm.shut_down

    def block_tokenizer(self, entered: threading.Event, release: threading.Event) -> None:
        self.engine._tokenizer = T.HfTokenizer(entered, release)


@pytest.fixture(params=["vllm", "trtllm"])
async def lib(request: pytest.FixtureRequest) -> AsyncIterator[Library]:
    if request.param == "vllm":
        yield VllmLib()
    else:
        request.getfixturevalue("trt")
        engine, _llm = await T.started()
        yield TrtLib(engine)


def req(prompt: str = "x") -> GenerationRequest:
    return GenerationRequest(request_id=RID, model="llama-8b", prompt=prompt)


async def collect(engine: LibraryEngine, request: GenerationRequest, into: list[TokenDelta]) -> None:
    async for delta in engine.stream(request):
        into.append(delta)


async def test_deltas_then_one_final_with_the_prompt_tokens(lib: Library) -> None:
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(lib.engine, req(), got))
    await until(lib.knows, 5, "the library to have the request")
    lib.say(" a", (5,))
    lib.say("", ())  # nothing new: skipped
    lib.say(" b", (6,), finish="length")
    await asyncio.wait_for(task, 5)
    assert [(d.text, d.token_ids, d.finish_reason, d.prompt_tokens) for d in got] == [
        (" a", (5,), None, None),
        (" b", (6,), FinishReason.LENGTH, 2),
    ]
    assert lib.stops() == 0 and lib.engine.aborted == [] and not lib.engine._streams
    await lib.engine.abort(RID)  # finished: nothing to abort
    assert lib.stops() == 0 and lib.engine.aborted == []
    await lib.engine.shutdown()


async def test_abort_ends_the_stream_with_one_cancelled_delta(lib: Library) -> None:
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(lib.engine, req(), got))
    await until(lib.knows, 5, "the library to have the request")
    lib.say(" a", (5,))
    await until(lambda: len(got) == 1, 5, "the first delta")
    await lib.engine.abort(RID)
    await lib.engine.abort(RID)  # twice: recorded and sent once
    await asyncio.wait_for(task, 5)
    assert [d.finish_reason for d in got] == [None, FinishReason.CANCELLED]
    assert got[-1].prompt_tokens == 2
    assert lib.engine.aborted == [RID] and lib.stops() == lib.adapter_stops() == 1
    await lib.engine.abort("unknown")
    assert lib.engine.aborted == [RID]
    await lib.engine.shutdown()


async def test_abort_before_the_library_knows_the_request_still_cancels_it(lib: Library) -> None:
    entered, release = threading.Event(), threading.Event()
    lib.block_tokenizer(entered, release)
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(lib.engine, req("x y"), got))
    await until(entered.is_set, 5, "the tokenizer to be entered")
    await lib.engine.abort(RID)
    release.set()
    await asyncio.wait_for(task, 5)
    assert got == [TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=3)]
    assert not lib.knows()  # never submitted
    assert lib.engine.aborted == [RID]
    await lib.engine.shutdown()


async def test_a_cancelled_consumer_stops_the_request_once_and_propagates(lib: Library) -> None:
    task = asyncio.create_task(collect(lib.engine, req(), []))
    await until(lib.knows, 5, "the library to have the request")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lib.stops() == 1  # vLLM's generate() handler, or our abort for TensorRT-LLM: not both
    assert lib.adapter_stops() == (0 if lib.closes_itself else 1)
    assert lib.engine.aborted == [RID] and not lib.engine._streams
    await lib.engine.shutdown()


async def test_a_consumer_that_stops_iterating_stops_the_request(lib: Library) -> None:
    stream = lib.engine.stream(req())
    first = asyncio.ensure_future(stream.__anext__())
    await until(lib.knows, 5, "the library to have the request")
    lib.say(" a", (5,))
    assert (await first).token_ids == (5,)
    await stream.aclose()  # type: ignore[attr-defined]
    assert lib.stops() == 1 and lib.adapter_stops() == (0 if lib.closes_itself else 1)
    assert lib.engine.aborted == [RID] and not lib.engine._streams
    await lib.engine.shutdown()


async def test_shutdown_ends_pending_streams_with_engine_dead(lib: Library) -> None:
    got: list[TokenDelta] = []
    task = asyncio.create_task(collect(lib.engine, req(), got))
    await until(lib.knows, 5, "the library to have the request")
    await lib.engine.shutdown()
    with pytest.raises(EngineDead):
        await asyncio.wait_for(task, 5)
    assert lib.shut_down() and lib.stops() == 1 and got == []
    with pytest.raises(EngineDead):
        await lib.engine.check_health()
    with pytest.raises(EngineDead):
        await lib.engine.tokenize(req())


@pytest.mark.parametrize(
    "make",
    [
        lambda: VllmEngine(V.WORKER, VllmSettings(), device_count=1, constraints=vllm_structured),
        lambda: TrtllmEngine(T.WORKER, TrtllmSettings(), device_count=1, constraints=trtllm_guided),
    ],
    ids=["vllm", "trtllm"],
)
async def test_an_unstarted_engine_is_dead_and_shuts_down_cleanly(make: Any) -> None:
    engine = make()
    with pytest.raises(EngineDead):
        await engine.check_health()
    assert engine.stats() == EngineStats(steps=0)
    await engine.shutdown()


async def test_requests_that_arrive_together_are_tokenised_in_one_call_and_prefill_their_own_ids() -> None:
    """The skeleton's batch tokenizer (workers/engines/prompts.py), shared by both adapters, seen through
    vLLM's fake: eight streams started in one loop turn are rendered by one call of the tokenizer on a
    list, and each request reaches the library with its own ids; a bad one among them fails alone."""
    from tests.workers.test_batch_tokenizer import ListTokenizer

    tok = ListTokenizer()
    llm = V.FakeAsyncLLM()
    engine = V.started(llm, tokenizer=tok)
    words = {f"r{i}": " ".join(["w" * (i + 1)] * (i + 1)) for i in range(8)}
    reqs = [GenerationRequest(request_id=rid, model="llama-8b", prompt=text) for rid, text in words.items()]
    reqs.append(GenerationRequest(request_id="bad", model="llama-8b"))  # neither prompt nor messages
    tasks = {r.request_id: asyncio.create_task(collect(engine, r, [])) for r in reqs}
    await until(lambda: len(llm.seen) == len(words), 5, "every good request to reach vLLM")
    assert tok.calls == [("list", 8, True)]  # the bad request never reached the tokenizer
    for rid, text in words.items():
        assert llm.seen[rid][0]["prompt_token_ids"] == [1] + [100 + len(w) for w in text.split()]
    with pytest.raises(InvalidRequest) as bad:
        await asyncio.wait_for(tasks.pop("bad"), 5)
    assert bad.value.violations[0].field == "prompt" and "bad" not in llm.seen
    for rid in words:
        llm.emit(rid, V.output("", (), finish="stop", prompt_ids=llm.seen[rid][0]["prompt_token_ids"]))
    await asyncio.wait_for(asyncio.gather(*tasks.values()), 5)
    await engine.shutdown()


async def test_requests_waiting_to_be_tokenised_at_shutdown_end_with_engine_dead(lib: Library) -> None:
    """One request is being tokenised, another waits for the next batch when the engine shuts down (its
    tokenizer thread with it): both end with EngineDead, neither with the thread pool's RuntimeError."""
    entered, release = threading.Event(), threading.Event()
    lib.block_tokenizer(entered, release)
    first = asyncio.create_task(collect(lib.engine, req("a b"), []))
    await until(entered.is_set, 5, "the tokenizer to be entered")
    other = GenerationRequest(request_id="r2", model="llama-8b", prompt="c")
    second = asyncio.create_task(collect(lib.engine, other, []))
    await until(lambda: len(lib.engine._prompts._waiting) == 1, 5, "r2 to wait behind the batch in the tokenizer")
    shutting = asyncio.create_task(lib.engine.shutdown())
    await until(lambda: lib.engine._dead is not None, 5, "the engine to be marked dead")
    release.set()
    await asyncio.wait_for(shutting, 5)
    for task in (first, second):
        with pytest.raises(EngineDead):
            await asyncio.wait_for(task, 5)
    assert not lib.knows()
