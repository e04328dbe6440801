"""Sampling parameters as an engine takes them: every default filled in, every value checked
(:func:`resolve_sampling`). Pure Python, so engines without torch (the fake one) share the rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from llamamesh import sampling
from llamamesh.errors import FieldViolation, InvalidRequest
from llamamesh.types import ResponseConstraint, SamplingParams

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0
MAX_LOGPROBS = sampling.MAX_LOGPROBS
# Our SamplingParams fields that vLLM's and TensorRT-LLM's SamplingParams take under the same name,
# passed only when set (:func:`library_sampling_kwargs`'s ``optional``; an engine may add its own).
PASSED_WHEN_SET = (
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "min_tokens",
)


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
    # None: free text.
    constraint: ResponseConstraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def checked(params: SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """``params`` checked by the shared rules (llamamesh/sampling.py) and normalised (a temperature
    below 1e-5 is greedy, one below 1e-2 is raised to it): what every engine runs. Stop token ids
    must also lie in the vocabulary when its size is known. Raises InvalidRequest naming every bad
    field; the first violation of a list field names the field itself (``stop``, not ``stop[1]``)."""
    found = sampling.violations(params)
    if vocab_size is not None and not any(v.field.startswith("stop_token_ids") for v in found):
        found += [
            FieldViolation("stop_token_ids", f"token ids must be in [0, {vocab_size}), got {t}")
            for t in params.stop_token_ids
            if t >= vocab_size
        ][:1]
    if found:
        raise InvalidRequest([FieldViolation(v.field.split("[")[0], v.description) for v in found])
    return sampling.normalized(params)


def resolve_sampling(params: SamplingParams, vocab_size: int) -> ResolvedSampling:
    """Fill in the defaults of :func:`checked` parameters; InvalidRequest names any bad field."""
    p = checked(params if params.max_tokens is not None else replace(params, max_tokens=DEFAULT_MAX_TOKENS), vocab_size)
    max_tokens = p.max_tokens or DEFAULT_MAX_TOKENS
    return ResolvedSampling(
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if p.temperature is None else float(p.temperature),
        top_p=1.0 if p.top_p is None else float(p.top_p),
        top_k=0 if p.top_k is None or p.top_k in (-1, 0) else p.top_k,
        min_p=0.0 if p.min_p is None else float(p.min_p),
        presence_penalty=0.0 if p.presence_penalty is None else float(p.presence_penalty),
        frequency_penalty=0.0 if p.frequency_penalty is None else float(p.frequency_penalty),
        repetition_penalty=1.0 if p.repetition_penalty is None else float(p.repetition_penalty),
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed,
        ignore_eos=bool(p.ignore_eos),
        min_tokens=p.min_tokens or 0,
        logprobs=p.logprobs,
        constraint=p.constraint,
    )


def library_sampling_kwargs(
    params: SamplingParams, optional: Sequence[str], vocab_size: int | None = None
) -> dict[str, Any]:
    """The keyword arguments vLLM's and TensorRT-LLM's ``SamplingParams`` take alike: max_tokens and
    temperature always (our defaults), each of ``optional`` (same name on both sides) only when set,
    top_k -1 or 0 as 0 (off), stop strings and stop token ids as lists. The parameters are
    :func:`checked` first (InvalidRequest naming the field; tiny temperatures normalised), so every
    engine runs the same values (``vocab_size``: stop token ids checked against it). Each adapter
    adds the rest."""
    params = checked(params, vocab_size)
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
