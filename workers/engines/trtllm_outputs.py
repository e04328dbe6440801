"""TensorRT-LLM's outputs as ours: what one CUMULATIVE ``RequestOutput`` adds to what was sent, as a
TokenDelta, and its finish reason. Pure: testable without TensorRT-LLM.

Written from TensorRT-LLM's documentation and source only, never run against it (see trtllm.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llamamesh.types import FinishReason, TokenDelta, TokenLogprob
from workers.engines import adapter
from workers.engines.adapter import token_logprobs


def finish_reason_of(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    """TensorRT-LLM's finish_reason ('stop', 'length', 'timeout', 'cancelled') and stop_reason (the stop
    string or stop token id) as ours (adapter.finish_reason_of): "cancelled" is CANCELLED; "timeout" (a
    request timeout, which we never set) and anything else raise InternalError."""
    return adapter.finish_reason_of(reason, stop_reason, engine="TensorRT-LLM", cancelled="cancelled")


@dataclasses.dataclass
class Sent:
    """How much of a request's cumulative output has been yielded already."""

    text: int = 0
    tokens: int = 0


def delta_of(output: Any, sent: Sent, n_logprobs: int | None) -> TokenDelta:
    """What one cumulative TensorRT-LLM output adds to what was ``sent`` (advanced in place). At a stop
    TensorRT-LLM trims the stop string (text) and stop-word tokens off the cumulative fields; what was
    already sent stays sent (TensorRT-LLM does not hold back a possible stop-string prefix as vLLM does).
    Cut from the cumulative fields rather than with ``text_diff`` / ``token_ids_diff`` (which exist:
    tensorrt_llm/executor/result.py), which do not account for that trimming."""
    if not output.outputs:
        return TokenDelta()
    completion = output.outputs[0]
    text = completion.text or ""
    ids = completion.token_ids or ()
    new_ids = tuple(ids[sent.tokens :])  # slices only: the cumulative lists grow with the output
    logprobs: tuple[TokenLogprob, ...] = ()
    if n_logprobs is not None and completion.logprobs:
        logprobs = token_logprobs(new_ids, completion.logprobs[sent.tokens : len(ids)], n_logprobs)
    delta = TokenDelta(
        text=text[sent.text :],
        token_ids=new_ids,
        logprobs=logprobs,
        finish_reason=finish_reason_of(completion.finish_reason, completion.stop_reason),
    )
    sent.text = max(sent.text, len(text))
    sent.tokens = max(sent.tokens, len(ids))
    return delta
