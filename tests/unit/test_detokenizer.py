"""Incremental detokenisation and stop strings, on small tokenizers built in memory (no files, no hub)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workers.engines.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStrings

pytestmark = pytest.mark.timeout(30)

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Café crème brûlée à la carte, naïve façade, Ångström, Dvořák.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",  # noqa: RUF001 - full-width punctuation on purpose
    "Emoji: 🙂🚀👩‍💻🇫🇷 and ✨ sparkles ✨ ok",
]
SAMPLES = [
    "Hi 🙂! Café 日本語 🚀🚀 naïve 👩‍💻 done.",
    "中文文本🇫🇷 crème brûlée ✨",
    "plain ascii text only",
    "🙂",
]


class HFLike:
    """The ``decode`` signature of a transformers tokenizer, over a ``tokenizers.Tokenizer``."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def byte_level() -> HFLike:
    """GPT-2 style byte-level BPE (like SmolLM2's): multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return HFLike(tok)


@pytest.fixture(scope="module")
def metaspace() -> HFLike:
    """SentencePiece style (Llama 2): "▁" marks spaces and decode drops the first one."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>", *byte_tokens])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return HFLike(tok)


def stream(tok: HFLike, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_level_deltas_never_split_a_character(byte_level: HFLike, text: str) -> None:
    ids = byte_level.encode(text)
    assert len(ids) > len(text.encode()) // 4  # small vocab: characters really span tokens
    deltas = stream(byte_level, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == byte_level.decode(ids) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_metaspace_concatenation_equals_the_full_decode(metaspace: HFLike, text: str) -> None:
    ids = metaspace.encode(text)
    deltas = stream(metaspace, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == metaspace.decode(ids)


def test_an_emoji_is_emitted_whole_by_the_token_that_completes_it(byte_level: HFLike) -> None:
    ids = byte_level.encode("a🚀")
    detok = IncrementalDetokenizer(byte_level)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == "a🚀"
    assert "🚀" in deltas[-1]
    assert all(d in ("", "a", "🚀", "a🚀") for d in deltas)


def test_special_tokens_are_skipped(byte_level: HFLike) -> None:
    eos = byte_level.tok.token_to_id("<eos>")
    ids = [*byte_level.encode("Hi 🙂"), eos, *byte_level.encode(" ok")]
    assert "".join(stream(byte_level, ids)) == "Hi 🙂 ok"


def test_an_unfinished_character_is_flushed_at_the_end(byte_level: HFLike) -> None:
    ids = byte_level.encode("ok🚀")
    detok = IncrementalDetokenizer(byte_level)
    partial = [detok.push(i) for i in ids[:-1]]
    assert "".join(partial) == "ok"
    assert detok.flush() == byte_level.decode(ids[:-1])[len("ok") :]


def test_random_id_sequences_concatenate_to_the_full_decode(byte_level: HFLike) -> None:
    rng = random.Random(7)
    vocab = byte_level.tok.get_vocab_size()
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        assert "".join(stream(byte_level, ids)) == byte_level.decode(ids)


# --- stop strings


def feed_all(stops: StopStrings, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, stopped = stops.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(stops.flush())
    return out, False


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    stops = StopStrings(["STOP"])
    assert stops.feed("hello S") == ("hello ", False)
    assert stops.held == "S"
    assert stops.feed("T") == ("", False)
    assert stops.feed("x") == ("STx", False)
    assert stops.held == ""


def test_the_stop_string_and_what_follows_are_dropped() -> None:
    out, stopped = feed_all(StopStrings(["STOP"]), ["a S", "TO", "P and more", "never seen"])
    assert stopped
    assert "".join(out) == "a "


def test_a_stop_string_inside_one_delta() -> None:
    out, stopped = feed_all(StopStrings(["\n\n"]), ["one\n\ntwo"])
    assert (out, stopped) == (["one"], True)


def test_the_earliest_of_several_stop_strings_wins() -> None:
    stops = StopStrings(["world", "lo w"])
    assert stops.feed("hello world") == ("hel", True)
    assert stops.stopped == "lo w"


def test_held_text_is_released_when_the_stream_ends() -> None:
    out, stopped = feed_all(StopStrings(["</answer>"]), ["42 </ans"])
    assert not stopped
    assert out == ["42 ", "</ans"]


def test_nothing_is_checked_or_held_while_min_tokens_is_not_reached() -> None:
    stops = StopStrings(["END"])
    assert stops.feed("an END", check=False) == ("an END", False)
    assert stops.feed(" E", check=True) == (" ", False)
    assert stops.feed("ND", check=True) == ("", True)


def test_after_a_stop_nothing_more_comes_out() -> None:
    stops = StopStrings(["x"])
    assert stops.feed("ax") == ("a", True)
    assert stops.feed("more") == ("", True)
    assert stops.flush() == ""


# --- a resumed sequence: the text at the resume point


def resumed(tok: HFLike, ids: list[int], k: int, stop: list[str]) -> tuple[str, str] | None:
    """The text a caller gets of ``ids`` with ``stop``: from a run of the first ``k`` tokens (what it
    emitted of them, held text and an incomplete character not) and a resumed run of the rest. None
    if the first run ended at a stop string (there is nothing to resume)."""
    first, stops = IncrementalDetokenizer(tok), StopStrings(stop)
    before = "".join(stops.feed(first.push(i))[0] for i in ids[:k])
    if stops.stopped is not None:
        return None
    detok, stops = IncrementalDetokenizer(tok), StopStrings(stop)
    stops.prime(detok.seed(ids[:k]))
    after = ""
    for i in ids[k:]:
        text, stopped = stops.feed(detok.push(i))
        after += text
        if stopped:
            return before, after
    return before, after + stops.feed(detok.flush())[0] + stops.flush()


@pytest.mark.parametrize("stop", [[], ["🚀🚀"], ["Café 日"], ["ne."]], ids=["none", "emoji", "words", "the-end"])
def test_a_resume_at_any_token_joins_the_text_and_finds_a_stop_string_across_it(
    byte_level: HFLike, stop: list[str]
) -> None:
    """Cut anywhere, inside a character or inside a possible stop string: the text before the cut and
    the resumed run's join as the uninterrupted run's, which ends at the same stop string."""
    text = SAMPLES[0]
    ids = byte_level.encode(text)
    whole = text.split(stop[0])[0] if stop else text
    cuts = [(k, got) for k in range(len(ids) + 1) if (got := resumed(byte_level, ids, k, stop)) is not None]
    # some cuts fall where the first run held text back (a possible stop string, a partial character)
    assert any(before != byte_level.decode(ids[:k]) for k, (before, _after) in cuts)
    for k, (before, after) in cuts:
        assert before + after == whole, (k, before, after)


def test_a_seeded_sequence_emits_the_character_its_last_tokens_left_incomplete(byte_level: HFLike) -> None:
    ids = byte_level.encode("ok🚀")
    k = len(ids) - 1  # the rocket's last byte still to come
    detok = IncrementalDetokenizer(byte_level)
    assert detok.seed(ids[:k]) == "ok"
    assert detok.push(ids[k]) == "🚀"
