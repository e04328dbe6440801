"""What the GPU engine adapters share (workers/engines/adapter.py), through each adapter's own entry
points, one suite for both: prompt rendering and length, finish reasons, logprobs. What is really
engine-specific stays in test_vllm_mapping.py and test_trtllm_mapping.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from llamamesh.errors import InternalError, InvalidRequest, PromptTooLong
from llamamesh.types import ChatMessage, FinishReason, GenerationRequest
from workers.engines import adapter, prompts, trtllm_outputs, trtllm_requests, vllm_outputs, vllm_requests
from workers.engines.transformers_batch import Batch

pytestmark = pytest.mark.timeout(10)


class Lp(NamedTuple):
    """vllm.logprobs.Logprob's and tensorrt_llm.executor.result.Logprob's fields."""

    logprob: float
    rank: int | None


class Engine(NamedTuple):
    name: str
    finish_reason_of: Callable[[str | None, Any], FinishReason | None]
    cancelled: str  # its word for an aborted request
    others: tuple[str, ...]  # endings that are internal errors
    check_length: Callable[[int, int, str], None]


ENGINES = [
    Engine("vllm", vllm_outputs.finish_reason_of, "abort", ("error", "something-new"), vllm_requests.check_prompt_len),
    Engine(
        "trtllm",
        trtllm_outputs.finish_reason_of,
        "cancelled",
        ("timeout", "not_finished"),
        trtllm_requests.check_prompt_tokens,
    ),
]
each = pytest.mark.parametrize("engine", ENGINES, ids=[e.name for e in ENGINES])


@each
@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [
        (None, None, None),
        ("stop", None, FinishReason.STOP),  # EOS / the end token
        ("stop", 128009, FinishReason.STOP),  # a stop token id
        ("stop", "###", FinishReason.STOP_SEQUENCE),  # a stop string
        ("length", None, FinishReason.LENGTH),
    ],
)
def test_finish_reasons(engine: Engine, reason: str | None, stop_reason: Any, expected: FinishReason | None) -> None:
    assert engine.finish_reason_of(reason, stop_reason) is expected


@each
def test_the_engines_own_abort_is_cancelled_and_other_endings_are_internal_errors(engine: Engine) -> None:
    assert engine.finish_reason_of(engine.cancelled, None) is FinishReason.CANCELLED
    for reason in engine.others:
        with pytest.raises(InternalError, match=reason):
            engine.finish_reason_of(reason, None)


def test_vllms_repetition_ending_is_a_stop() -> None:
    """Only with repetition_detection, which we never set."""
    assert vllm_outputs.finish_reason_of("repetition", "repetition_detected") is FinishReason.STOP


@each
def test_prompt_length_leaves_room_for_one_output_token(engine: Engine) -> None:
    engine.check_length(4095, 4096, "prompt")
    with pytest.raises(PromptTooLong) as exc:
        engine.check_length(4096, 4096, "messages")
    assert exc.value.violations[0].field == "messages" and "limit 4095" in exc.value.violations[0].description
    with pytest.raises(InvalidRequest) as empty:
        engine.check_length(0, 4096, "prompt")
    assert not isinstance(empty.value, PromptTooLong)


def test_an_unknown_limit_is_left_to_the_library() -> None:
    trtllm_requests.check_prompt_tokens(10_000, 0, "prompt")  # LLAMAMESH_TRTLLM_MAX_SEQ_LEN unset: TensorRT-LLM checks


def test_logprobs_keep_the_sampled_token_and_the_top_n_by_rank() -> None:
    positions = [
        # Sampled token 7 ranked 3rd; dict order is not rank order.
        {7: Lp(-2.0, 3), 4: Lp(-1.5, 2), 9: Lp(-0.1, 1)},
        # Sampled token 5 is outside the top 2 (rank 40): it is not an alternative.
        {5: Lp(-6.0, 40), 3: Lp(-0.2, 1), 8: Lp(-1.9, 2)},
    ]
    out = adapter.token_logprobs([7, 5], positions, n=2)
    assert [(t.token_id, t.logprob) for t in out] == [(7, -2.0), (5, -6.0)]
    assert [(a.token_id, a.logprob) for a in out[0].top] == [(9, -0.1), (4, -1.5)]
    assert [(a.token_id, a.logprob) for a in out[1].top] == [(3, -0.2), (8, -1.9)]
    # n = 3 includes the sampled token at its rank.
    assert [a.token_id for a in adapter.token_logprobs([7], positions[:1], n=3)[0].top] == [9, 4, 7]


def test_logprobs_zero_alternatives_floats_gaps_and_not_requested() -> None:
    only = adapter.token_logprobs([7], [{7: Lp(-0.3, 1)}], n=0)
    assert len(only) == 1 and only[0].logprob == -0.3 and only[0].top == ()
    assert adapter.token_logprobs([5], [-0.5], 3)[0].logprob == -0.5  # TensorRT-LLM's floats: the sampled token's
    gap = adapter.token_logprobs([5], [None], 3)[0]  # nothing known for that position
    assert gap.token_id == 5 and gap.logprob != gap.logprob and gap.top == ()  # NaN
    assert adapter.token_logprobs([7], [{7: Lp(-0.3, 1)}], n=None) == ()
    assert adapter.token_logprobs([7], None, n=2) == ()


class StubTokenizer:
    """One id per word (100 + its length), BOS=1 with special tokens; a chat template of one line per turn."""

    chat_template = "{% for m in messages %}..."

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [100 + len(w) for w in text.split()]

    def apply_chat_template(
        self, chat: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool, chat_template: str = ""
    ) -> str:
        return " ".join(f"<{m['role']}> {m['content']}" for m in chat) + " <assistant>"


def request(**kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", **kw)


def test_every_engine_renders_the_same_request_to_the_same_ids() -> None:
    """vLLM, TensorRT-LLM and the CPU engine share the rendering: a prompt keeps its special tokens,
    messages go through the chat template without extra ones."""
    tok = StubTokenizer()
    batch = Batch.__new__(Batch)  # only its tokenizer: encode() renders as the GPU adapters do
    batch.tokenizer, batch.max_model_len = tok, 4096
    for req, ids in [
        (request(prompt="hi there"), [1, 102, 105]),
        (request(messages=(ChatMessage("user", "hi"),)), [106, 102, 111]),
    ]:
        assert prompts.render_prompt_ids(req, tok) == ids
        assert batch.encode(req) == ids
    for kw, field in [
        ({}, "prompt"),
        ({"messages": ()}, "messages"),
        ({"prompt": "a", "messages": (ChatMessage("user", "b"),)}, "messages"),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            prompts.render_prompt_ids(request(**kw), tok)
        assert exc.value.violations[0].field == field


def test_an_adapter_must_give_every_hook_of_the_skeleton() -> None:
    from llamamesh.settings import WorkerSettings

    class Partial(adapter.LibraryEngine):
        def _new_stream(self) -> Any:
            return None

    with pytest.raises(TypeError, match="_deltas"):
        Partial(WorkerSettings())  # type: ignore[abstract]
