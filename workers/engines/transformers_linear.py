"""Batch-invariant decode for the CPU engine: every decode-step matrix product has one fixed shape
(:func:`use_row_groups`), so a request's output does not depend on how many others share its step.
What it costs small batches: docs/benchmarks.md ("What settings and features cost"). Only the
engine's torch thread runs the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Rows per decode GEMM call. A multiple of 4: every kernel class seen here for M >= 4 is one class.
ROWS = 16


class _Grouped:
    """The forward of one ``nn.Linear``: decode inputs in groups of ROWS rows, anything else as is."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if x.dim() < 2 or x.shape[-2] != 1:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        pad = -n % ROWS
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        out = [F.linear(g, weight, bias) for g in flat.split(ROWS)]
        joined = out[0] if len(out) == 1 else torch.cat(out)
        return joined[:n].reshape(*x.shape[:-1], joined.shape[-1])


def use_row_groups(model: Any) -> int:
    """Make every ``nn.Linear`` of ``model`` decode in fixed-shape row groups; returns how many.
    Idempotent (a module already switched is left alone).

    Why: oneDNN and MKL pick their GEMM kernel (and the order in which it sums along ``K``) by the
    shape of the call. A decode step multiplies ``[B, K]`` activations by each weight; with ``B = 1``
    the libraries take a GEMV path, with ``B = 2, 3`` another, with ``B >= 4`` a third (in float32
    and bfloat16, and with oneDNN capped at AVX-512 or AVX2). The rounding then depends on how many
    other requests share the step, and greedy text parts at the first near-tie.

    How: while a model decodes (one position per row, ``x.shape[-2] == 1``), each ``nn.Linear`` runs
    its rows in groups of exactly :data:`ROWS` (the last group zero-padded). Every call then has the
    same ``(ROWS, K, N)`` shape and thread count, so the library runs the same kernel the same way
    for every group of every step; a GEMM never mixes rows, so a row's result depends on that row and
    the weights alone. Prefill (many positions of one sequence) is left as it is: it runs one
    sequence alone. A step of one sequence pays for ``ROWS`` rows; a full group costs what it did."""
    switched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not isinstance(module.__dict__.get("forward"), _Grouped):
            module.forward = _Grouped(module)  # type: ignore[method-assign,assignment]  # an instance attribute
            switched += 1
    return switched
