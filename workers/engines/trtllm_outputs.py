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
from workers.engines.detokenizer import StopStrings


def finish_reason_of(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    """TensorRT-LLM's finish_reason ('stop', 'length', 'timeout', 'cancelled') and stop_reason (the stop
    string or stop token id) as ours (adapter.finish_reason_of): "cancelled" is CANCELLED; "timeout" (a
    request timeout, which we never set) and anything else raise InternalError."""
    return adapter.finish_reason_of(reason, stop_reason, engine="TensorRT-LLM", cancelled="cancelled")


@dataclasses.dataclass
class Sent:
    """How much of a request's cumulative output has been read already, and with stop strings, the
    text held back while it could be the start of one (``stops``; checked past ``min_tokens``)."""

    text: int = 0
    tokens: int = 0
    stops: StopStrings | None = None
    min_tokens: int = 0


def delta_of(output: Any, sent: Sent, n_logprobs: int | None) -> TokenDelta:
    """What one cumulative TensorRT-LLM output adds to what was ``sent`` (advanced in place).

    TensorRT-LLM streams a token at a time and finds a stop string once its text holds it whole
    (result.py ``_handle_response`` cuts the text there and aborts; ``_handle_sequence`` trims token
    ids): the first tokens of a stop string of several are streamed before it is seen. So the text
    is held back here while it could begin a stop string (``Sent.stops``, as the CPU engine does):
    the caller never sees a stop string or its start. With min_tokens the stop strings are not given
    to TensorRT-LLM (it would stop before min_tokens: trtllm_requests.sampling_kwargs) and end the
    request here, STOP_SEQUENCE, once found past min_tokens. The token ids go as they come, with
    the stop string's (as vLLM's do). Cut from the cumulative fields rather than with ``text_diff`` /
    ``token_ids_diff`` (which exist: tensorrt_llm/executor/result.py), which do not account for that
    trimming."""
    if not output.outputs:
        return TokenDelta()
    completion = output.outputs[0]
    text = completion.text or ""
    ids = completion.token_ids or ()
    new_ids = tuple(ids[sent.tokens :])  # slices only: the cumulative lists grow with the output
    logprobs: tuple[TokenLogprob, ...] = ()
    if n_logprobs is not None and completion.logprobs:
        logprobs = token_logprobs(new_ids, completion.logprobs[sent.tokens : len(ids)], n_logprobs)
    finish = finish_reason_of(completion.finish_reason, completion.stop_reason)
    new_text = text[sent.text :]
    if sent.stops is not None:
        new_text, found = sent.stops.feed(new_text, check=len(ids) >= sent.min_tokens)
        if found:
            finish = FinishReason.STOP_SEQUENCE
        elif finish is not None and finish is not FinishReason.STOP_SEQUENCE:
            new_text += sent.stops.flush()  # what was held, no stop string followed
    delta = TokenDelta(text=new_text, token_ids=new_ids, logprobs=logprobs, finish_reason=finish)
    sent.text = max(sent.text, len(text))
    sent.tokens = max(sent.tokens, len(ids))
    return delta
