"""A request as the trtllm engine hands it to TensorRT-LLM: its ``SamplingParams`` keyword arguments,
and TensorRT-LLM's argument errors as ours, naming our field. Pure: testable without TensorRT-LLM.

Written from TensorRT-LLM's documentation and source only, never run against it (see trtllm.py).
"""

from __future__ import annotations

import re
from typing import Any

from llamamesh.errors import InvalidRequest, PromptTooLong
from llamamesh.types import ResponseConstraint, SamplingParams
from workers.engines import adapter
from workers.engines.adapter import SAMPLING_FIELDS
from workers.engines.constraints import constraint_error
from workers.engines.params import PASSED_WHEN_SET, library_sampling_kwargs

_PROMPT_TOO_LONG = re.compile(r"prompt length|prompt_len|input length", re.I)


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """TensorRT-LLM SamplingParams keyword arguments: max_tokens and temperature always (our defaults;
    TensorRT-LLM samples greedily when temperature, top_p and top_k are all unset, and stops at 32
    tokens), every other field only when set; top_k -1 or 0 becomes TensorRT-LLM's 0 (all logits).
    Its fields used: ``max_tokens, temperature, top_p, top_k, min_p, presence_penalty,
    frequency_penalty, repetition_penalty, stop, stop_token_ids, seed, ignore_eos, min_tokens,
    logprobs, guided_decoding``; it raises ValueError from its ``_validate``
    (tensorrt_llm/sampling_params.py). Stop strings go only without min_tokens."""
    # min_p: SamplingParams documents it ("None means using C++ runtime default 0.0"); whether the
    # PyTorch backend's sampler applies it is not stated in what we read. A release whose SamplingParams
    # lacks a field refuses it with TypeError, which stream() reports naming the field.
    kwargs = library_sampling_kwargs(params, PASSED_WHEN_SET)
    if params.min_tokens and params.stop:
        # TensorRT-LLM ends at a stop string in its text whatever min_tokens says (result.py
        # ``_handle_response``); the engine matches them itself then, past min_tokens (trtllm_outputs.Sent).
        kwargs.pop("stop", None)
    if params.logprobs is not None:
        # Ours: the sampled token's logprob plus the top n (0: none). TensorRT-LLM's: n per token, and
        # 0 means no logprobs at all; so ask for at least 1 and keep n alternatives (token_logprobs).
        kwargs["logprobs"] = max(1, params.logprobs)
    return kwargs


def invalid_from_trtllm(message: str, input_field: str, constraint: ResponseConstraint | None = None) -> InvalidRequest:
    """A TensorRT-LLM argument error (SamplingParams or generate_async) as ours, naming our field: one
    about the request's response_format names it; a prompt length error is PromptTooLong; else the
    sampling field the message names first."""
    about_format = constraint_error(message, constraint)
    if about_format is not None:
        return about_format
    if _PROMPT_TOO_LONG.search(message):
        return PromptTooLong.field(input_field, message)
    named = [
        (m.start(), name) for name in SAMPLING_FIELDS if (m := re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message))
    ]
    if named:
        return InvalidRequest.field(min(named)[1], message)
    return InvalidRequest.field("request", message)


def check_prompt_tokens(n_tokens: int, max_seq_len: int, input_field: str) -> None:
    """Refuse an empty prompt, and (when LLAMAMESH_TRTLLM_MAX_SEQ_LEN is set, the only limit known here)
    one that leaves no room for an output token; else TensorRT-LLM checks the length itself."""
    adapter.check_prompt_tokens(n_tokens, max_seq_len, input_field, "max_seq_len")
