"""What the engine adapters share: rendering a request's prompt to token ids, the prompt-length check,
finish reasons and logprobs as ours. Pure Python (no torch, vLLM or TensorRT-LLM import), so each
adapter imports it without pulling in another's library. Each adapter names its own library's
words (its finish reasons, its length limit) where they differ.

Used by: vllm.py and trtllm.py (all of it), transformers_batch.py (the prompt and its length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from llamamesh.errors import InternalError, InvalidRequest, PromptTooLong
from llamamesh.types import FinishReason, GenerationRequest, SamplingParams, TokenLogprob, TopLogprob

# Our SamplingParams field names, which the libraries' errors may name.
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def render_prompt_ids(request: GenerationRequest, tokenizer: Any) -> list[int]:
    """The token ids for ``request``: the prompt as is (with the tokenizer's special tokens, as vLLM's
    completions path), or the messages through the chat template (no extra special tokens, as its chat
    path). InvalidRequest if neither or both are set, or the template fails."""
    if request.prompt is not None and request.messages is not None:
        raise InvalidRequest.field("messages", "set prompt or messages, not both")
    if request.messages is not None:
        if not request.messages:
            raise InvalidRequest.field("messages", "at least one message is required")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest.field("messages", "this model has no chat template; send a prompt")
        chat = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja raises whatever the template author chose
            raise InvalidRequest.field("messages", f"the chat template rejected them: {exc}") from exc
        return list(tokenizer.encode(text, add_special_tokens=False))
    if request.prompt is None:
        raise InvalidRequest.field("prompt", "either prompt or messages is required")
    return list(tokenizer.encode(request.prompt))


def check_prompt_tokens(n_tokens: int, limit: int, input_field: str, limit_name: str) -> None:
    """Refuse an empty prompt, and one that leaves no room for an output token within ``limit`` (the
    engine's ``limit_name``: max_model_len, max_seq_len); 0: the limit is not known here."""
    if n_tokens == 0:
        raise InvalidRequest.field(input_field, "the prompt has no tokens")
    if limit and n_tokens >= limit:
        raise PromptTooLong.field(
            input_field, f"{n_tokens} tokens, limit {limit - 1} ({limit_name} {limit} counts the output)"
        )


def finish_reason_of(
    reason: str | None, stop_reason: int | str | None, *, engine: str, cancelled: str, also_stop: Collection[str] = ()
) -> FinishReason | None:
    """A library's finish_reason / stop_reason as ours: a stop string (str stop_reason) is
    STOP_SEQUENCE; the end token or a stop token id is STOP; ``cancelled`` is the library's word for
    an aborted request, ``also_stop`` other endings that mean STOP. Anything else raises InternalError."""
    if reason is None:
        return None
    if reason == "stop":
        return FinishReason.STOP_SEQUENCE if isinstance(stop_reason, str) else FinishReason.STOP
    if reason == "length":
        return FinishReason.LENGTH
    if reason == cancelled:
        return FinishReason.CANCELLED
    if reason in also_stop:
        return FinishReason.STOP
    raise InternalError(f"{engine} ended the request with finish_reason {reason!r}")


def token_logprobs(
    token_ids: Sequence[int], positions: Sequence[Any] | None, n: int | None
) -> tuple[TokenLogprob, ...]:
    """Per-token logprobs as TokenLogprobs: the sampled token's logprob and at most ``n`` alternatives
    by rank (the sampled one among them when it ranks in the top ``n``). A position is the libraries'
    ``{token_id: Logprob(logprob, rank)}``, or a float (the sampled token's alone, as TensorRT-LLM may
    give), or None (nothing known: NaN)."""
    if n is None or not positions:
        return ()
    keep = max(n, 0)
    out = []
    for token, position in zip(token_ids, positions, strict=False):
        if position is not None and not isinstance(position, Mapping):
            out.append(TokenLogprob(int(token), float(position)))
            continue
        entries = position or {}
        chosen = entries.get(token)
        ranked = sorted(
            entries.items(),
            key=lambda kv: (kv[1].rank if kv[1].rank is not None else float("inf"), -kv[1].logprob),
        )
        top = tuple(TopLogprob(int(t), float(lp.logprob)) for t, lp in ranked[:keep])
        out.append(TokenLogprob(int(token), float(chosen.logprob) if chosen is not None else float("nan"), top))
    return tuple(out)
