"""A resumed request's text on a library that streams its text behind its tokens while it has stop
strings (workers/engines/resumed_text.py), against a model of vLLM 0.26's detokenizer: for a cut
after every token, and for a second cut after every token of the resumed run, the caller's text is
the uninterrupted run's, and a stop string across a failover point ends the run where the
uninterrupted one ended. Then through the vLLM adapter's stream skeleton, over its fake library."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from llamamesh.types import FinishReason, GenerationRequest, SamplingParams, TokenDelta
from tests.unit import test_vllm_mapping as V
from tests.waiting import until
from workers.engines.resumed_text import ResumedText

pytestmark = pytest.mark.timeout(30)


class Chars:
    """One token per character (its code point)."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


def held_back(stops: Sequence[str]) -> int:
    return max((len(s) for s in stops), default=1) - 1


def library(tokens: Sequence[int], stops: Sequence[str]) -> list[TokenDelta]:
    """``tokens`` (one a step) as vLLM streams them: its text grows by each token's; the first stop
    string in it ends the request there (the completing token kept, the text cut before it); the
    text goes out the longest stop string's length less one characters behind (all of it at the
    end). A resumed run's library sees only its own tokens' text."""
    hold, text, sent, out = held_back(stops), "", 0, []
    for i, token in enumerate(tokens):
        text += chr(token)
        hits = [text.index(s) for s in stops if s in text]
        reason = FinishReason.STOP_SEQUENCE if hits else (FinishReason.LENGTH if i == len(tokens) - 1 else None)
        text = text[: min(hits)] if hits else text
        upto = len(text) if reason is not None else max(sent, len(text) - hold)
        out.append(TokenDelta(text=text[sent:upto], token_ids=(token,), finish_reason=reason))
        sent = upto
        if reason is not None:
            break
    return out


def resumed(tokens: Sequence[int], k: int, stops: Sequence[str]) -> list[TokenDelta]:
    """The library's run of the tokens after the first ``k``, as the caller gets it."""
    seam = ResumedText(Chars(), tokens[:k], stops, held_back(stops), check=True)
    out = []
    for got in library(tokens[k:], stops):
        out.append(delta := seam.feed(got))
        if delta.finish_reason is not None:
            break
    return out


def text(deltas: Sequence[TokenDelta]) -> str:
    return "".join(d.text for d in deltas)


def tokens_of(deltas: Sequence[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


CASES = [
    pytest.param("Sure, here it is.\nUser: and then more text", ("\nUser:",), id="stop"),
    pytest.param("Sure, here it is.\nUse it, and\nUs again", ("\nUser:", "##"), id="held-no-stop"),
    pytest.param("a#b##c", ("##", "\nUser:"), id="short-stop-long-hold"),
    pytest.param("xyxyxz and on", ("xyxz", "yxz"), id="overlapping"),
]


@pytest.mark.parametrize(("answer", "stops"), CASES)
def test_every_cut_and_every_second_cut_give_the_uninterrupted_text(answer: str, stops: tuple[str, ...]) -> None:
    tokens = Chars.encode(answer)
    whole = library(tokens, stops)
    generated = tokens_of(whole)
    for k in range(1, len(generated)):
        before = whole[:k]
        rest = resumed(tokens, k, stops)
        assert text(before) + text(rest) == text(whole), k
        assert tokens_of(rest) == generated[k:] and rest[-1].finish_reason is whole[-1].finish_reason, k
        for j in range(1, len(rest)):  # the resumed run cut again
            again = resumed(tokens, k + j, stops)
            assert text(before) + text(rest[:j]) + text(again) == text(whole), (k, j)
            assert tokens_of(again) == generated[k + j :] and again[-1].finish_reason is whole[-1].finish_reason


def test_a_stop_across_the_cut_ends_the_run_at_the_token_that_completes_it() -> None:
    tokens = Chars.encode("ok\nUser: more")
    seam = ResumedText(Chars(), tokens[:5], ("\nUser:",), 5, check=True)  # "ok\nUs" held
    assert seam.held == "ok\nUs"
    # the held text goes out as vLLM's would: all but the last 5 characters of the tokens' text
    assert seam.feed(TokenDelta(token_ids=(ord("e"),))) == TokenDelta(text="o", token_ids=(ord("e"),))
    last = seam.feed(TokenDelta(token_ids=(ord("r"), ord(":"), ord(" "))))
    assert last == TokenDelta(
        text="k", token_ids=(ord("r"), ord(":"), ord(" ")), finish_reason=FinishReason.STOP_SEQUENCE
    )
    assert seam.stopped and not seam.open


def test_below_min_tokens_the_held_text_goes_out_but_no_stop_is_searched() -> None:
    tokens = Chars.encode("ok\nUser: more")
    seam = ResumedText(Chars(), tokens[:5], ("\nUser:",), 5, check=False)
    deltas = [seam.feed(TokenDelta(token_ids=(t,))) for t in tokens[5:9]]
    final = seam.feed(TokenDelta(text="er: more", token_ids=(), finish_reason=FinishReason.LENGTH))
    assert text([*deltas, final]) == "ok\nUser: more" and not seam.stopped


def test_a_stop_inside_the_held_text_is_not_the_seams() -> None:
    """Only a stop string that crosses the failover point is found here; one wholly before it (under
    min_tokens then) or wholly after it is the library's."""
    seam = ResumedText(Chars(), Chars.encode("x##ab"), ("##", "abcdef"), 5, check=True)
    assert seam.feed(TokenDelta(token_ids=(ord("c"),))).finish_reason is None
    assert seam.feed(TokenDelta(token_ids=Chars.encode("##"))).finish_reason is None


# --- through the vLLM adapter's stream skeleton (adapter.LibraryEngine), over its fake AsyncLLM


class CharTokenizer(V.StubTokenizer):
    decode = staticmethod(Chars.decode)


def resumed_request(carried: str, stops: tuple[str, ...], min_tokens: int | None = None) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=20, stop=stops, min_tokens=min_tokens)
    return GenerationRequest(
        request_id="r1", model="llama-8b", prompt="x", sampling=sampling, resume_token_ids=tuple(Chars.encode(carried))
    )


async def run_resumed(
    request: GenerationRequest, outputs: list[tuple[str, str, str | None]]
) -> tuple[list[TokenDelta], V.FakeAsyncLLM]:
    llm = V.FakeAsyncLLM()
    engine = V.started(llm, tokenizer=CharTokenizer())
    got: list[TokenDelta] = []

    async def consume() -> None:
        async for delta in engine.stream(request):
            got.append(delta)

    task = asyncio.create_task(consume())
    await until(lambda: "r1" in llm.queues, 5, "vLLM to have the request")
    for said, new, finish in outputs:
        if "r1" in llm.queues:
            llm.emit("r1", V.output(said, Chars.encode(new), finish=finish, prompt_ids=[1, 101]))
    await asyncio.wait_for(task, 5)
    await engine.shutdown()
    return got, llm


async def test_vllm_a_stop_across_the_cut_ends_the_stream_and_stops_the_request() -> None:
    got, llm = await run_resumed(
        resumed_request("Fine.\nUs", ("\nUser:",)), [("", "e", None), ("", "r", None), ("", ":", None)]
    )
    assert text(got) == "e." and got[-1].finish_reason is FinishReason.STOP_SEQUENCE  # the caller had "Fin"
    assert tokens_of(got) == Chars.encode("er:") and got[-1].prompt_tokens == 2
    assert llm.internal_aborts == ["r1"]  # generate() closed: vLLM stopped it


async def test_vllm_the_held_text_comes_with_the_resumed_runs_text() -> None:
    outputs = [
        ("", "e", None),
        ("", "d", None),
        ("", " ", None),
        ("", "i", None),
        ("", "t", None),
        ("ed", " ", None),
        (" it ", "", "length"),
    ]
    got, llm = await run_resumed(resumed_request("Fine.\nUs", ("\nUser:",)), outputs)
    assert text(got) == "e.\nUsed it " and got[-1].finish_reason is FinishReason.LENGTH
    assert llm.internal_aborts == []


async def test_vllm_without_stop_strings_a_resumed_stream_is_the_librarys() -> None:
    got, _llm = await run_resumed(resumed_request("Fine.", ()), [(" ok", " ok", "length")])
    assert text(got) == " ok"
