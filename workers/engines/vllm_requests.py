"""A request as the vllm engine hands it to vLLM: its ``SamplingParams`` keyword arguments, its
priority, and vLLM's validation errors as ours, naming our field. Pure: testable without vLLM."""

from __future__ import annotations

import re
from typing import Any

from llamamesh.errors import InvalidRequest, PromptTooLong
from llamamesh.types import GenerationRequest, SamplingParams
from workers.engines.adapter import SAMPLING_FIELDS, check_prompt_tokens
from workers.engines.params import PASSED_WHEN_SET, library_sampling_kwargs

# Passed to vLLM only when set, beside the fields both libraries take. Where our defaults differ from
# vLLM's (max_tokens 16), they follow the CPU engine.
_OPTIONAL_SAMPLING = (*PASSED_WHEN_SET, "logprobs", "n")
# Added to a batch item's vLLM priority (lower runs first) so that every interactive request, whatever
# its own priority, is admitted before any batch item.
BATCH_PRIORITY_OFFSET = 1 << 20
_PROMPT_TOO_LONG = re.compile(r"prompt.*longer than the maximum model length", re.S)


def engine_priority(request: GenerationRequest, policy: str) -> int:
    """vLLM's priority for a request (lower is scheduled first): ours negated (higher GenerateRequest
    priority first), and every batch item after every interactive request. 0 under fcfs, where vLLM
    refuses any other value."""
    if policy != "priority":
        return 0
    return -request.priority + (BATCH_PRIORITY_OFFSET if request.batch_id else 0)


def sampling_kwargs(params: SamplingParams, vocab_size: int | None = None) -> dict[str, Any]:
    """vLLM SamplingParams keyword arguments (without ``output_kind``): max_tokens and temperature
    always (our defaults), every other field only when set; top_k -1 or 0 becomes vLLM's 0 (off).
    Stop token ids must lie in the vocabulary when its size is given."""
    return library_sampling_kwargs(params, _OPTIONAL_SAMPLING, vocab_size)


def invalid_from_vllm(message: str, parameter: str | None, input_field: str) -> InvalidRequest:
    """A vLLM validation error (SamplingParams or generate) as our error, naming our field."""
    if _PROMPT_TOO_LONG.search(message):
        return PromptTooLong.field(input_field, message)
    if parameter in SAMPLING_FIELDS:
        return InvalidRequest.field(parameter, message)
    first = re.match(r"\W*(\w+)", message)
    if first is not None and first.group(1) in SAMPLING_FIELDS:
        return InvalidRequest.field(first.group(1), message)
    if "prompt" in message or "Token id" in message:
        return InvalidRequest.field(input_field, message)
    return InvalidRequest.field("request", message)


def check_prompt_len(n_tokens: int, max_model_len: int, input_field: str) -> None:
    """vLLM needs at least one token of room for the output (it checks too; this names our field)."""
    check_prompt_tokens(n_tokens, max_model_len, input_field, "max_model_len")
