"""Hypothesis strategies for sampling parameters over their whole range: every float32 (0, -0.0,
subnormals, 1e-40, 1e38, the largest float, infinities, NaN) in every float field, the int32 and
int64 extremes in the integer fields, empty and odd stop strings."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from llamamesh.types import SamplingParams

MAX_F32 = 3.4028234663852886e38
INT32 = (-(2**31), 2**31 - 1)
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-40, 1.1754943508222875e-38, 1e-6, 1e-5, 1e-2, 0.5, 1.0, 2.0, 10.0,
               1e38, MAX_F32, -1e-40, -1.0, -MAX_F32, math.inf, -math.inf, math.nan]  # fmt: skip
EDGE_INTS = [INT32[0], -2, -1, 0, 1, 2, 20, 21, INT32[1]]

floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(width=32))
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(*INT32))


def optional(s: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(st.none(), s)


def sampling_fields(max_tokens: st.SearchStrategy[int]) -> st.SearchStrategy[dict[str, object]]:
    """Every sampling field of a request (None: unset); ``max_tokens`` bounds how long a valid one runs."""
    return st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": max_tokens,
            "temperature": floats,
            "top_p": floats,
            "top_k": ints,
            "min_p": floats,
            "presence_penalty": floats,
            "frequency_penalty": floats,
            "repetition_penalty": floats,
            "seed": st.integers(-(2**63), 2**63 - 1),
            "ignore_eos": st.booleans(),
            "min_tokens": st.one_of(st.integers(-3, 12), st.sampled_from(EDGE_INTS)),
            "logprobs": st.one_of(st.sampled_from([-1, 0, 1, 20, 21]), st.sampled_from(EDGE_INTS)),
            "stop": st.lists(st.text(max_size=4), max_size=3),
            "stop_token_ids": st.lists(st.one_of(st.integers(0, 50_000), st.sampled_from(EDGE_INTS)), max_size=3),
        },
    )


def sampling_params(max_tokens: st.SearchStrategy[int]) -> st.SearchStrategy[SamplingParams]:
    def build(fields: dict[str, object]) -> SamplingParams:
        for name in ("stop", "stop_token_ids"):
            if name in fields:
                fields[name] = tuple(fields[name])  # type: ignore[arg-type]
        return SamplingParams(**fields)  # type: ignore[arg-type]

    return sampling_fields(max_tokens).map(build)
