"""The GPU adapters' prompt rendering in batches (workers/engines/prompts.py ``BatchTokenizer``):
requests that arrive together are encoded in one call of the tokenizer on a list, with the same ids
as one call each, one request's bad input fails only that request, and a caller that went away is
left out. A fake tokenizer counts the calls; the real SmolLM2 tokenizer checks the ids."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from llamamesh.errors import InvalidRequest
from llamamesh.types import ChatMessage, GenerationRequest
from tests.waiting import until
from workers.engines.prompts import BatchTokenizer, render_prompt_ids

pytestmark = pytest.mark.timeout(60)


class ListTokenizer:
    """The Hugging Face surface, one id per word (BOS=1 with special tokens), recording each call:
    ``("list", n, special)`` for a call on a list, ``("one", special)`` for ``encode``. ``gate``, when
    set, holds every call until it is released (after ``entered``)."""

    chat_template = "{{ messages }}"

    def __init__(self, takes_lists: bool = True) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.takes_lists = takes_lists
        self.entered = threading.Event()
        self.gate: threading.Event | None = None

    def _wait(self) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)

    def _ids(self, text: str, special: bool) -> list[int]:
        if "boom" in text:
            raise ValueError("this tokenizer cannot encode 'boom'")
        return ([1] if special else []) + [100 + len(w) for w in text.split()]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._wait()
        self.calls.append(("one", add_special_tokens))
        return self._ids(text, add_special_tokens)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        self._wait()
        if not self.takes_lists:
            raise TypeError("text input must be of type str")
        self.calls.append(("list", len(texts), add_special_tokens))
        return {"input_ids": [self._ids(t, add_special_tokens) for t in texts]}

    def apply_chat_template(
        self, chat: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool, chat_template: str = ""
    ) -> str:
        if any(m["role"] == "tool" for m in chat):
            raise ValueError("no tool role in this template")
        return " ".join(f"<{m['role']}> {m['content']}" for m in chat) + " <assistant>"


def prompt(text: str, n: int = 0) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{n}", model="m", prompt=text)


def chat(text: str, role: str = "user") -> GenerationRequest:
    return GenerationRequest(request_id="c", model="m", messages=(ChatMessage(role, text),))


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


async def waiting(batcher: BatchTokenizer, n: int) -> None:
    """Until ``n`` requests wait for the next batch (each queues when its task runs)."""
    await until(lambda: len(batcher._waiting) >= n, 5, f"{n} requests waiting for the next batch", poll_s=0.001)


async def test_requests_that_arrive_together_are_encoded_in_one_call_with_the_same_ids(
    executor: concurrent.futures.Executor,
) -> None:
    tok = ListTokenizer()
    batcher = BatchTokenizer(lambda: tok, executor)
    requests = [prompt(" ".join("w" * (i % 7 + 1) for _ in range(i + 1)), i) for i in range(10)]
    got = await asyncio.gather(*(batcher.ids(r) for r in requests))
    assert tok.calls == [("list", 10, True)] and list(batcher.batches) == [10]
    assert got == [render_prompt_ids(r, ListTokenizer()) for r in requests]


async def test_requests_arriving_during_a_batch_go_in_the_next_one_and_a_batch_is_bounded(
    executor: concurrent.futures.Executor,
) -> None:
    tok = ListTokenizer()
    tok.gate = threading.Event()
    batcher = BatchTokenizer(lambda: tok, executor, max_batch=4)
    first = asyncio.ensure_future(batcher.ids(prompt("a")))
    assert await asyncio.to_thread(tok.entered.wait, 10)
    rest = [asyncio.ensure_future(batcher.ids(prompt("b c", i))) for i in range(6)]
    await waiting(batcher, 6)
    tok.gate.set()
    assert await first == [1, 101]
    assert await asyncio.gather(*rest) == [[1, 101, 101]] * 6
    assert list(batcher.batches) == [1, 4, 2]
    assert tok.calls == [("one", True), ("list", 4, True), ("list", 2, True)]


async def test_one_bad_request_fails_alone_and_chat_and_prompt_requests_share_a_batch(
    executor: concurrent.futures.Executor,
) -> None:
    tok = ListTokenizer()
    batcher = BatchTokenizer(lambda: tok, executor)
    requests = [
        prompt("a b"),
        chat("hi"),
        GenerationRequest(request_id="x", model="m"),
        chat("x", role="tool"),
        prompt("c"),
        chat("there you"),
    ]
    got = await asyncio.gather(*(batcher.ids(r) for r in requests), return_exceptions=True)
    assert got[0] == [1, 101, 101] and got[4] == [1, 101]
    assert got[1] == [106, 102, 111] and got[5] == [106, 105, 103, 111]
    assert isinstance(got[2], InvalidRequest) and got[2].violations[0].field == "prompt"
    assert isinstance(got[3], InvalidRequest) and got[3].violations[0].field == "messages"
    assert "no tool role" in str(got[3])
    assert sorted(tok.calls) == [("list", 2, False), ("list", 2, True)]  # one call per special-token setting


@pytest.mark.parametrize("takes_lists", [False, True], ids=["no-list-call", "list-call-fails"])
async def test_a_tokenizer_without_a_working_list_call_encodes_each_text(
    executor: concurrent.futures.Executor,
    takes_lists: bool,
) -> None:
    tok = ListTokenizer(takes_lists=takes_lists)
    batcher = BatchTokenizer(lambda: tok, executor)
    texts = ["a", "b c", "boom d"] if takes_lists else ["a", "b c", "d e f"]
    got = await asyncio.gather(*(batcher.ids(prompt(t)) for t in texts), return_exceptions=True)
    assert got[0] == [1, 101] and got[1] == [1, 101, 101]
    if takes_lists:  # "boom" fails the list call: each text is encoded alone, and only "boom d" fails
        assert isinstance(got[2], ValueError)
    else:
        assert got[2] == [1, 101, 101, 101]
    assert [c for c in tok.calls if c[0] == "one"] == [("one", True)] * 3


async def test_a_caller_that_goes_away_while_waiting_is_left_out(executor: concurrent.futures.Executor) -> None:
    tok = ListTokenizer()
    tok.gate = threading.Event()
    batcher = BatchTokenizer(lambda: tok, executor)
    first = asyncio.ensure_future(batcher.ids(prompt("a")))
    assert await asyncio.to_thread(tok.entered.wait, 10)
    gone = asyncio.ensure_future(batcher.ids(prompt("b")))
    stays = asyncio.ensure_future(batcher.ids(prompt("c d")))
    await waiting(batcher, 2)
    gone.cancel()
    tok.gate.set()
    assert await first == [1, 101] and await stays == [1, 101, 101]
    assert gone.cancelled()
    assert list(batcher.batches) == [1, 1]


async def test_a_shut_down_executor_fails_the_waiting_requests(executor: concurrent.futures.Executor) -> None:
    executor.shutdown()
    batcher = BatchTokenizer(ListTokenizer, executor)
    with pytest.raises(RuntimeError, match="shutdown"):
        await asyncio.wait_for(batcher.ids(prompt("a")), 5)


async def test_the_real_tokenizer_gives_the_same_ids_in_a_batch(executor: concurrent.futures.Executor) -> None:
    """SmolLM2's tokenizer (a Hugging Face fast tokenizer, as vLLM's): random-token prompts as the
    benchmarks send, odd text and chat requests, in one batch, against one encode call each."""
    from transformers import AutoTokenizer

    from tests.contract.conftest import smollm2_folder

    tok = AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True)
    rng = random.Random(7)
    texts = [tok.decode([rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 300))]) for _ in range(40)]
    texts += ["", " ", "héllo wörld ✓ 🙂", "a\n\n\tb", "<|im_start|>user\nhi<|im_end|>"]
    requests = [prompt(t, i) for i, t in enumerate(texts)]
    requests += [chat(t) for t in texts[:8]]
    batcher = BatchTokenizer(lambda: tok, executor)
    got = await asyncio.gather(*(batcher.ids(r) for r in requests))
    assert list(batcher.batches) == [len(requests)]
    assert got == [render_prompt_ids(r, tok) for r in requests]


async def test_the_record_of_batch_sizes_stays_bounded(executor: concurrent.futures.Executor) -> None:
    tok = ListTokenizer()
    batcher = BatchTokenizer(lambda: tok, executor)
    for i in range(100):
        assert await batcher.ids(prompt("a b", i)) == [1, 101, 101]
    assert list(batcher.batches) == [1] * 64
