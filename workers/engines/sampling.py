"""Sampling for the CPU engine: per-sequence logits processing (the parameters' rules: params.py).

Pure torch on small tensors, no model: the processors take ``[n, vocab]`` float logits and
return processed logits; :class:`SequenceSampler` holds one sequence's state (its generator,
token counts for the penalties, the tokens ``min_tokens`` bans, the grammar matcher of a response
constraint) and :func:`sample_batch` picks one token per row of a batch, with one ``argmax`` for all
plain greedy rows.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

from llamamesh.types import TokenLogprob, TopLogprob
from workers.engines.params import ResolvedSampling

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


def generator_seed(seed: int) -> int:
    """A request's 64-bit seed as the CPU generator's seed. torch's CPU generator (mt19937) keeps only
    the low 32 bits, so seeds that differ only above them would give the same sample: the high half
    is mixed into the low one (a seed in [0, 2**32) stays itself)."""
    bits = seed & _U64
    high = bits >> 32
    return (bits & _U32) ^ ((high * 0x9E3779B1) & _U32)  # (odd: every high half moves it differently)


# --- processors: [n, vocab] float logits in, processed logits out.


def ban_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Make ``token_ids`` impossible (used by min_tokens for EOS and the stop tokens)."""
    return logits.index_fill(-1, token_ids, -math.inf)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF-style: logits of tokens already seen (prompt or output) are divided by ``penalty`` when
    positive and multiplied by it when negative."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return bounded(torch.where(seen, penalised, logits))


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI-style, over generated tokens: ``logit -= frequency * count + presence * (count > 0)``."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return bounded(logits / temperature)


def bounded(logits: torch.Tensor) -> torch.Tensor:
    """Logits that softmax and argmax can take: +inf (a value that overflowed, e.g. divided by a tiny
    repetition penalty) becomes the largest finite float, NaN becomes -inf (never sampled); -inf
    (a banned token) stays."""
    return torch.nan_to_num(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max, neginf=-math.inf)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` highest logits (ties with the k-th are kept too)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the more likely tokens before it already reach p.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, -math.inf)


def sample_from(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``softmax(logits)``; ``[n]`` long."""
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class SequenceSampler:
    """One sequence's sampling state; used from the engine's torch thread only."""

    def __init__(
        self,
        params: ResolvedSampling,
        vocab_size: int,
        prompt_ids: Sequence[int],
        eos_ids: Collection[int],
        matcher: Any = None,
    ) -> None:
        """``matcher``: an ``xgrammar.GrammarMatcher`` for the request's response constraint
        (workers/engines/constraints.py); only tokens it allows are sampled, and every token of the
        output (resumed ones included) goes through it."""
        self.params = params
        self.matcher = matcher
        self._bitmask: torch.Tensor | None = None
        self.generated = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(generator_seed(params.seed))
        self.counts: torch.Tensor | None = None
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab_size)
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            if prompt_ids:
                self.seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        banned = {t for t in banned if 0 <= t < vocab_size}
        self.banned: torch.Tensor | None = None
        if params.min_tokens and banned:
            self.banned = torch.tensor(sorted(banned), dtype=torch.long)

    @property
    def plain_greedy(self) -> bool:
        """True when the next token is simply the argmax of the raw logits."""
        return self.params.greedy and not self.params.penalised and not self._banning and self.matcher is None

    @property
    def _banning(self) -> bool:
        return self.banned is not None and self.generated < self.params.min_tokens

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply min_tokens, the penalties, temperature, top-k, top-p and min-p to ``[1, vocab]`` logits."""
        p = self.params
        if self.matcher is not None:
            logits = self._constrained(logits)
        if self._banning:
            assert self.banned is not None
            logits = ban_tokens(logits, self.banned)
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, p.repetition_penalty)
        if self.counts is not None:
            logits = apply_presence_frequency(logits, self.counts, p.presence_penalty, p.frequency_penalty)
        if p.greedy:
            return logits
        if p.temperature != 1.0:
            logits = apply_temperature(logits, p.temperature)
        logits = apply_top_k(logits, p.top_k)
        logits = apply_top_p(logits, p.top_p)
        return apply_min_p(logits, p.min_p)

    def _constrained(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token the grammar does not allow next at -inf (a copy: the batch's
        logits also give the logprobs)."""
        import xgrammar as xgr

        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        self.matcher.fill_next_token_bitmask(self._bitmask)
        logits = logits.float().clone()
        xgr.apply_token_bitmask_inplace(logits, self._bitmask)
        return logits

    def choose(self, logits: torch.Tensor) -> int:
        """The next token for ``[1, vocab]`` raw logits."""
        processed = self.process(logits)
        if self.params.greedy:
            return int(processed.argmax(dim=-1)[0])
        return int(sample_from(processed, self.generator)[0])

    def observe(self, token_id: int, generated: bool = True) -> None:
        """Record a token of the output (for the penalties, and min_tokens unless ``generated`` is
        False: a resumed token an earlier attempt generated, which the budget no longer counts)."""
        self.generated += int(generated)
        # Resumed tokens went through the matcher when the request was admitted.
        m = self.matcher
        if generated and m is not None and not m.is_terminated() and not m.accept_token(token_id):
            raise ValueError(f"token {token_id} does not follow the response format")
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True


def sample_batch(logits: torch.Tensor, samplers: Sequence[SequenceSampler]) -> list[int]:
    """One token per row of ``[n, vocab]`` float logits; plain greedy rows share one argmax."""
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    out = [0] * len(samplers)
    if len(plain) == len(samplers):
        return logits.argmax(dim=-1).tolist()
    if plain:
        index = torch.tensor(plain, dtype=torch.long)
        for i, token in zip(plain, logits.index_select(0, index).argmax(dim=-1).tolist(), strict=True):
            out[i] = token
    for i, sampler in enumerate(samplers):
        if not sampler.plain_greedy:
            out[i] = sampler.choose(logits[i : i + 1])
    return out


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], chosen: Sequence[int], top: Sequence[int]
) -> list[TokenLogprob]:
    """Logprobs of ``chosen[j]`` in row ``rows[j]`` of the raw ``[n, vocab]`` logits, with ``top[j]``
    alternatives each (log_softmax before any processing, like vLLM's raw logprobs)."""
    if not rows:
        return []
    logprobs = logits.index_select(0, torch.tensor(list(rows), dtype=torch.long)).log_softmax(dim=-1)
    picked = logprobs.gather(-1, torch.tensor(list(chosen), dtype=torch.long)[:, None]).squeeze(-1).tolist()
    n_top = max(top)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if n_top:
        values, ids = torch.topk(logprobs, n_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out = []
    for j, (token, lp, n) in enumerate(zip(chosen, picked, top, strict=True)):
        alternatives = tuple(TopLogprob(top_ids[j][k], top_values[j][k]) for k in range(n))
        out.append(TokenLogprob(token_id=token, logprob=lp, top=alternatives))
    return out
