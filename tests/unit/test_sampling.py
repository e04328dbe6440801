"""Sampling: parameter checks and each logits processor, on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from llamamesh.errors import InvalidRequest
from llamamesh.types import SamplingParams
from workers.engines.params import DEFAULT_MAX_TOKENS, ResolvedSampling, resolve_sampling
from workers.engines.sampling import (
    SequenceSampler,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    ban_tokens,
    sample_batch,
    token_logprobs,
)

pytestmark = pytest.mark.timeout(30)

VOCAB = 8


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


# --- parameters


def test_defaults() -> None:
    r = resolve_sampling(SamplingParams(), VOCAB)
    assert r == ResolvedSampling()
    assert r.max_tokens == DEFAULT_MAX_TOKENS == 256
    assert (r.temperature, r.top_p, r.top_k, r.min_p, r.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert resolve_sampling(SamplingParams(top_k=-1), VOCAB).top_k == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(stop_token_ids=(3, VOCAB)), "stop_token_ids"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(min_p=2.0), "min_p"),
        (SamplingParams(presence_penalty=3.0), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.5), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(stop=("ok", "")), "stop"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(n=0), "n"),
        (SamplingParams(n=17), "n"),
        (SamplingParams(n=2, temperature=0.0), "n"),
    ],
)
def test_values_the_engine_cannot_honour_name_their_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve_sampling(params, VOCAB)
    assert [v.field for v in info.value.violations] == [field]


# --- processors


def test_top_k_keeps_the_k_best() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5, 2.5, -3.0, 1.0]])
    assert kept(apply_top_k(logits, 3)) == [1, 3, 5]
    assert kept(apply_top_k(logits, 1)) == [1]
    assert apply_top_k(logits, 0) is logits
    assert kept(apply_top_k(logits, 100)) == list(range(8))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = logits_of([0.05, 0.5, 0.15, 0.3])
    assert kept(apply_top_p(logits, 0.4)) == [1]
    assert kept(apply_top_p(logits, 0.75)) == [1, 3]
    assert kept(apply_top_p(logits, 0.85)) == [1, 2, 3]
    assert kept(apply_top_p(logits, 1.0)) == [0, 1, 2, 3]
    assert kept(apply_top_p(logits, 1e-6)) == [1]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = logits_of([0.05, 0.5, 0.15, 0.3])
    assert kept(apply_min_p(logits, 0.2)) == [1, 2, 3]
    assert kept(apply_min_p(logits, 0.5)) == [1, 3]
    assert kept(apply_min_p(logits, 0.0)) == [0, 1, 2, 3]


def test_temperature_scales_the_logits() -> None:
    logits = torch.tensor([[1.0, -2.0, 4.0]])
    assert torch.equal(apply_temperature(logits, 0.5), torch.tensor([[2.0, -4.0, 8.0]]))


def test_presence_and_frequency_penalties_count_generated_tokens() -> None:
    logits = torch.zeros((1, 4))
    counts = torch.tensor([0.0, 1.0, 3.0, 0.0])
    out = apply_presence_frequency(logits, counts, presence=0.5, frequency=0.25)
    assert out[0].tolist() == [0.0, -0.75, -1.25, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([True, True, False, False])
    assert apply_repetition_penalty(logits, seen, 2.0)[0].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_ban_tokens() -> None:
    out = ban_tokens(torch.zeros((1, 4)), torch.tensor([0, 2]))
    assert kept(out) == [1, 3]


# --- per-sequence state


def sampler(
    vocab: int = VOCAB, prompt: tuple[int, ...] = (), eos: tuple[int, ...] = (0,), **kw: object
) -> SequenceSampler:
    return SequenceSampler(resolve_sampling(SamplingParams(**kw), vocab), vocab, list(prompt), eos)  # type: ignore[arg-type]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    s = sampler(temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    logits = torch.tensor([[9.0, 0.0, 1.0, 0.0, 0.0, 8.0, 0.0, 0.0]])
    assert not s.plain_greedy
    first = s.choose(logits)
    assert first == 2
    s.observe(first)
    assert s.choose(logits) == 2
    s.observe(2)
    assert s.plain_greedy
    assert s.choose(logits) == 0


def test_min_tokens_leaves_eos_alone_with_ignore_eos() -> None:
    s = sampler(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert s.banned is None
    assert s.choose(torch.tensor([[9.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])) == 0


def test_frequency_penalty_changes_greedy_choice_after_repeats() -> None:
    s = sampler(temperature=0.0, frequency_penalty=1.0)
    logits = torch.tensor([[0.0, 2.5, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    picks = []
    for _ in range(3):
        token = s.choose(logits)
        s.observe(token)
        picks.append(token)
    assert picks == [1, 2, 1]


def test_repetition_penalty_covers_the_prompt() -> None:
    s = sampler(temperature=0.0, repetition_penalty=2.0, prompt=(1,))
    assert s.choose(torch.tensor([[0.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])) == 2


def test_the_same_seed_gives_the_same_samples() -> None:
    logits = torch.randn((1, 1000), generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        s = sampler(vocab=1000, seed=seed, temperature=1.0)
        out = []
        for _ in range(20):
            token = s.choose(logits)
            s.observe(token)
            out.append(token)
        return out

    assert draws(1234) == draws(1234)
    assert draws(1234) != draws(4321)
    # The seed is 64 bits; the CPU generator keeps 32: seeds alike in their low half differ too.
    for a, b in [(1, 2**32 + 1), (0, 2**32), (-1, 2**63 - 1), (-5, 2**62 - 5)]:
        assert draws(a) != draws(b), (a, b)


def test_sampling_respects_the_filters() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5, 2.5, -3.0, 1.0]])
    s = sampler(seed=3, top_k=2)
    assert {s.choose(logits) for _ in range(50)} <= {1, 5}


def test_sample_batch_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 50.0, 0.0]])
    greedy = sampler(vocab=4, temperature=0.0)
    seeded = sampler(vocab=4, seed=1)
    also_greedy = sampler(vocab=4, temperature=0.0)
    assert sample_batch(logits, [greedy, also_greedy, seeded]) == [1, 3, 2]
    assert sample_batch(logits[:2], [greedy, also_greedy]) == [1, 3]


def test_token_logprobs_are_raw_log_softmax_with_top_alternatives() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = token_logprobs(logits, rows=[0, 1], chosen=[2, 0], top=[2, 0])
    expected = logits[0].log_softmax(-1)
    assert out[0].token_id == 2
    assert out[0].logprob == pytest.approx(float(expected[2]))
    assert [t.token_id for t in out[0].top] == [1, 2]
    assert out[0].top[0].logprob == pytest.approx(float(expected[1]))
    assert out[1].top == ()
    assert out[1].logprob == pytest.approx(math.log(0.25))
