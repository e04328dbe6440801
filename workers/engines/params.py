"""Sampling parameters as an engine takes them: every default filled in, every value checked
(:func:`resolve_sampling`). Pure Python, so engines without torch (the fake one) share the rules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llamamesh.errors import InvalidRequest
from llamamesh.types import SamplingParams

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class ResolvedSampling:
    """SamplingParams with every default filled in and every value checked."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    # 0: off.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs; N >= 0: the sampled token's logprob and N alternatives.
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest.field(name, "must be a finite number")
    return float(value)


def resolve_sampling(params: SamplingParams, vocab_size: int) -> ResolvedSampling:
    """Fill in the defaults; a value the engine cannot honour raises InvalidRequest naming its field."""
    max_tokens = DEFAULT_MAX_TOKENS if params.max_tokens is None else params.max_tokens
    if max_tokens < 1:
        raise InvalidRequest.field("max_tokens", "must be at least 1")
    temperature = 1.0 if params.temperature is None else _finite("temperature", params.temperature)
    if temperature < 0:
        raise InvalidRequest.field("temperature", "must be >= 0")
    top_p = 1.0 if params.top_p is None else _finite("top_p", params.top_p)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest.field("top_p", "must be in (0, 1]")
    top_k = 0 if params.top_k is None or params.top_k in (-1, 0) else params.top_k
    if top_k < 0:
        raise InvalidRequest.field("top_k", "must be -1 or 0 (off) or a positive number of tokens")
    min_p = 0.0 if params.min_p is None else _finite("min_p", params.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequest.field("min_p", "must be in [0, 1]")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        raw = getattr(params, name)
        value = 0.0 if raw is None else _finite(name, raw)
        if not -2.0 <= value <= 2.0:
            raise InvalidRequest.field(name, "must be in [-2, 2]")
        penalties[name] = value
    repetition = 1.0 if params.repetition_penalty is None else _finite("repetition_penalty", params.repetition_penalty)
    if repetition <= 0:
        raise InvalidRequest.field("repetition_penalty", "must be > 0")
    if any(not s for s in params.stop):
        raise InvalidRequest.field("stop", "stop strings must not be empty")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequest.field("stop_token_ids", f"token ids must be in [0, {vocab_size})")
    min_tokens = params.min_tokens or 0
    if min_tokens < 0:
        raise InvalidRequest.field("min_tokens", "must be >= 0")
    if min_tokens > max_tokens:
        raise InvalidRequest.field("min_tokens", f"must not exceed max_tokens ({max_tokens})")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest.field("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    return ResolvedSampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        repetition_penalty=repetition,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        seed=params.seed,
        ignore_eos=bool(params.ignore_eos),
        min_tokens=min_tokens,
        logprobs=params.logprobs,
    )


def library_sampling_kwargs(params: SamplingParams, optional: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments vLLM's and TensorRT-LLM's ``SamplingParams`` take alike: max_tokens and
    temperature always (our defaults), each of ``optional`` (same name on both sides) only when set,
    top_k -1 or 0 as 0 (off), stop strings and stop token ids as lists. Each adapter adds the rest."""
    kwargs: dict[str, Any] = {
        "max_tokens": DEFAULT_MAX_TOKENS if params.max_tokens is None else params.max_tokens,
        "temperature": DEFAULT_TEMPERATURE if params.temperature is None else params.temperature,
    }
    for name in optional:
        value = getattr(params, name)
        if value is not None:
            kwargs[name] = value
    if params.top_k is not None:
        kwargs["top_k"] = 0 if params.top_k in (-1, 0) else params.top_k
    if params.stop:
        kwargs["stop"] = list(params.stop)
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    return kwargs
