"""The rules of sampling parameters, one copy for the gateway and every engine: the gateway checks a
request with :func:`violations` (all bad fields at once) and sends the :func:`normalized`
parameters; every engine checks and normalises again through ``workers/engines/params.py`` (a job
may reach a worker without a gateway, and an engine must never be what finds out that a value
overflows). Ranges and the treatment of tiny temperatures follow vLLM's ``SamplingParams``. Pure
Python on the domain types; no I/O.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

from llamamesh.errors import FieldViolation
from llamamesh.schemas import dropped, unknown_type
from llamamesh.types import ConstraintKind, ResponseConstraint, SamplingParams

# A temperature below this (0, -0.0 and subnormals included) is greedy.
SAMPLING_EPS = 1e-5
# Dividing logits by less overflows float32 (vLLM's ``_MAX_TEMP``); any larger finite temperature is
# allowed: it only flattens the distribution.
MIN_TEMPERATURE = 1e-2
# A tiny repetition penalty divides positive logits towards infinity; the CPU engine clamps what
# overflows (workers/engines/sampling.py), so the request gets what it asked for (seen tokens
# favoured without bound) and nothing else is affected.
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20
# A response constraint's text (schema, regex, grammar) and a choice's options, at most.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 1024
# How deep a JSON schema (response format, tool parameters) may nest objects and lists: deeper ones
# are refused, not handed to a grammar compiler that recurses through them.
MAX_SCHEMA_DEPTH = 64
# GenerateRequest.n, at most (vLLM's own limit is higher; every sample holds a slot and KV blocks).
MAX_SAMPLES = 16


def _float(out: list[FieldViolation], name: str, value: float | None, ok: bool, why: str) -> None:
    if value is None:
        return
    if not math.isfinite(value):
        out.append(FieldViolation(name, f"must be a finite number, got {value!r}"))
    elif not ok:
        out.append(FieldViolation(name, f"{why}, got {value!r}"))


def violations(p: SamplingParams, max_tokens_cap: int | None = None) -> list[FieldViolation]:
    """Every field of ``p`` out of its range (unset fields are fine), named as in the public API:
    presence / frequency penalties in [-2, 2], top_p in (0, 1], min_p in [0, 1], top_k -1 or 0 (off)
    or positive, repetition_penalty in (0, 10], every float finite; a response constraint as
    :func:`constraint_violations` says, and never with ignore_eos or min_tokens (they would keep the
    end of sequence from the output the format has completed)."""
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
    _float(
        out,
        "repetition_penalty",
        r,
        r is not None and 0 < r <= MAX_REPETITION_PENALTY,
        f"must be in (0, {MAX_REPETITION_PENALTY:g}]",
    )
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
    if p.n is not None:
        if not 1 <= p.n <= MAX_SAMPLES:
            out.append(FieldViolation("n", f"must be in [1, {MAX_SAMPLES}], got {p.n}"))
        elif p.n > 1 and t is not None and math.isfinite(t) and t < SAMPLING_EPS:
            out.append(
                FieldViolation(
                    "n", f"n > 1 needs sampling (temperature > 0): greedy decoding gives {p.n} identical samples"
                )
            )
    if p.constraint is not None:
        out += constraint_violations(p.constraint)
        if p.ignore_eos:
            out.append(FieldViolation("ignore_eos", "cannot be combined with response_format"))
        if p.min_tokens:
            out.append(FieldViolation("min_tokens", "cannot be combined with response_format"))
    return out


def constraint_violations(c: ResponseConstraint) -> list[FieldViolation]:
    """What is wrong with a response constraint before any engine compiles it: a JSON schema parses
    as JSON, a regex compiles, a choice has options, sizes are bounded. Each engine then compiles it
    for its tokenizer and refuses what it cannot, naming the same field."""
    name = c.field
    if c.kind is ConstraintKind.JSON_OBJECT:
        return []
    if c.kind is ConstraintKind.CHOICE:
        if not c.options:
            return [FieldViolation(name, "give at least one option")]
        if len(c.options) > MAX_CHOICES:
            return [FieldViolation(name, f"at most {MAX_CHOICES} options, got {len(c.options)}")]
        if any(not o for o in c.options):
            return [FieldViolation(name, "options must not be empty")]
        if sum(len(o) for o in c.options) > MAX_CONSTRAINT_CHARS:
            return [FieldViolation(name, f"the options hold at most {MAX_CONSTRAINT_CHARS} characters")]
        return []
    if not c.text.strip():
        return [FieldViolation(name, "must not be empty")]
    if len(c.text) > MAX_CONSTRAINT_CHARS:
        return [FieldViolation(name, f"at most {MAX_CONSTRAINT_CHARS} characters, got {len(c.text)}")]
    if c.kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(c.text)
        except (ValueError, RecursionError) as exc:  # (nesting past Python's stack)
            return [FieldViolation(name, f"is not JSON: {exc}")]
        if json_depth(schema) > MAX_SCHEMA_DEPTH:
            return [FieldViolation(name, f"nests objects and lists at most {MAX_SCHEMA_DEPTH} deep")]
        if not isinstance(schema, (dict, bool)):
            return [FieldViolation(name, f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")]
        if why := unknown_type(schema) or dropped(schema):
            return [FieldViolation(name, why)]
    elif c.kind is ConstraintKind.REGEX:
        try:
            re.compile(c.text)
        except re.error as exc:
            return [FieldViolation(name, f"is not a regular expression: {exc}")]
    elif c.kind is ConstraintKind.GRAMMAR and "::=" not in c.text:
        return [FieldViolation(name, "an EBNF grammar of rules `name ::= ...`, with a `root` rule")]
    return []


def json_depth(value: object) -> int:
    """How deep ``value`` (parsed JSON) nests objects and lists: 0 for a scalar."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def normalized(p: SamplingParams) -> SamplingParams:
    """``p`` as every engine should run it (call after :func:`violations` found nothing): a
    temperature below SAMPLING_EPS becomes 0.0 (greedy, with top_p / top_k / min_p unset, as they
    mean nothing for an argmax), one below MIN_TEMPERATURE becomes MIN_TEMPERATURE."""
    t = p.temperature
    if t is None:
        return p
    if t < SAMPLING_EPS:
        return replace(p, temperature=0.0, top_p=None, top_k=None, min_p=None)
    if t < MIN_TEMPERATURE:
        return replace(p, temperature=MIN_TEMPERATURE)
    return p
