"""The rules of sampling parameters, one copy for the gateway and every engine.

The gateway checks a request with :func:`violations` (all bad fields at once) and sends the
:func:`normalized` parameters; every engine checks and normalises again through
``workers/engines/params.py`` (a job may reach a worker without a gateway, and an engine must
never be what finds out that a value overflows). Ranges and the treatment of tiny temperatures
follow vLLM's ``SamplingParams``:

- ``temperature`` below :data:`SAMPLING_EPS` (1e-5; 0, -0.0 and subnormals included) is greedy,
  and then top_p / top_k / min_p are reset, as they mean nothing for an argmax; a temperature in
  ``[SAMPLING_EPS, MIN_TEMPERATURE)`` is raised to :data:`MIN_TEMPERATURE` (1e-2), since dividing
  logits by less overflows float32 (vLLM's ``_MAX_TEMP``). Any larger finite value is allowed: it
  only flattens the distribution.
- ``repetition_penalty`` in (0, 10]: a tiny one divides positive logits towards infinity; the CPU
  engine clamps what overflows (workers/engines/sampling.py), so the request gets what it asked
  for (seen tokens favoured without bound) and nothing else is affected.
- presence / frequency penalties in [-2, 2], top_p in (0, 1], min_p in [0, 1], top_k -1 or 0
  (off) or positive, every float finite.

Pure Python on the domain types; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import replace

from llamamesh.errors import FieldViolation
from llamamesh.types import SamplingParams

SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20


def _float(out: list[FieldViolation], name: str, value: float | None, ok: bool, why: str) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        out.append(FieldViolation(name, f"must be a finite number, got {value!r}"))
    elif not ok:
        out.append(FieldViolation(name, f"{why}, got {value!r}"))


def violations(p: SamplingParams, max_tokens_cap: int | None = None) -> list[FieldViolation]:
    """Every field of ``p`` out of its range (unset fields are fine), named as in the public API."""
    out: list[FieldViolation] = []
    if p.max_tokens is not None:
        if max_tokens_cap is None and p.max_tokens < 1:
            out.append(FieldViolation("max_tokens", f"must be at least 1, got {p.max_tokens}"))
        elif max_tokens_cap is not None and not 1 <= p.max_tokens <= max_tokens_cap:
            out.append(FieldViolation("max_tokens", f"must be in [1, {max_tokens_cap}], got {p.max_tokens}"))
    t = p.temperature
    _float(out, "temperature", t, t is not None and t >= 0, "must be >= 0 (0: greedy)")
    _float(out, "top_p", p.top_p, p.top_p is not None and 0 < p.top_p <= 1, "must be in (0, 1]")
    if p.top_k is not None and p.top_k < -1:
        out.append(FieldViolation("top_k", f"must be -1 or 0 (off) or a positive number of tokens, got {p.top_k}"))
    _float(out, "min_p", p.min_p, p.min_p is not None and 0 <= p.min_p <= 1, "must be in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        _float(out, name, v, v is not None and -2 <= v <= 2, "must be in [-2, 2]")
    r = p.repetition_penalty
    _float(out, "repetition_penalty", r, r is not None and 0 < r <= MAX_REPETITION_PENALTY,
           f"must be in (0, {MAX_REPETITION_PENALTY:g}]")  # fmt: skip
    for i, s in enumerate(p.stop):
        if not s:
            out.append(FieldViolation(f"stop[{i}]", "stop strings must not be empty"))
    for i, tok in enumerate(p.stop_token_ids):
        if tok < 0:
            out.append(FieldViolation(f"stop_token_ids[{i}]", f"token ids are >= 0, got {tok}"))
    if p.min_tokens is not None:
        most = p.max_tokens
        if p.min_tokens < 0 or (most is not None and p.min_tokens > most):
            limit = f"[0, max_tokens={most}]" if most is not None else ">= 0"
            out.append(FieldViolation("min_tokens", f"must be in {limit}, got {p.min_tokens}"))
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        out.append(FieldViolation("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {p.logprobs}"))
    return out


def normalized(p: SamplingParams) -> SamplingParams:
    """``p`` as every engine should run it (call after :func:`violations` found nothing): a
    temperature below SAMPLING_EPS becomes 0.0 (greedy, with top_p / top_k / min_p unset), one below
    MIN_TEMPERATURE becomes MIN_TEMPERATURE."""
    t = p.temperature
    if t is None:
        return p
    if t < SAMPLING_EPS:
        return replace(p, temperature=0.0, top_p=None, top_k=None, min_p=None)
    if t < MIN_TEMPERATURE:
        return replace(p, temperature=MIN_TEMPERATURE)
    return p
