"""The routing policy: parsing the configured rules and choosing a pool."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from llamamesh import errors
from llamamesh.types import ChatMessage, GenerationRequest, SamplingParams
from services.routing import EXAMPLE_ROUTES, Access, RoutingPolicy

pytestmark = pytest.mark.timeout(10)


def req(prompt: str = "hi", tier: str = "", **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="m",
        prompt=prompt,
        sampling=SamplingParams(max_tokens=16, **sampling),  # type: ignore[arg-type]
        metadata=MappingProxyType({"tier": tier} if tier else {}),
    )


@pytest.fixture
def example() -> RoutingPolicy:
    return RoutingPolicy.parse(EXAMPLE_ROUTES)


def test_the_shipped_example(example: RoutingPolicy) -> None:
    assert example.pools == ("premium", "trtllm", "vllm")
    short = "word " * 100  # ~125 tokens by the bytes / 4 estimate
    assert example.choose(req(short, temperature=0.0), "default")[0] == "trtllm"
    assert example.choose(req(short, temperature=0.7), "default")[0] == "default"
    assert example.choose(req(short), "default")[0] == "default"  # unset temperature is 1, not 0
    long = "x" * (4 * 9000)
    assert example.choose(req(long, temperature=0.0), "default")[0] == "vllm"  # > 8192 tokens
    mid = "x" * (4 * 2000)
    assert example.choose(req(mid, temperature=0.0), "default")[0] == "default"  # neither short nor long
    assert example.choose(req(short, top_p=0.5), "default")[0] == "vllm"
    assert example.choose(req(short, top_p=0.9), "default")[0] == "default"
    premium = Access(tier="premium")
    pool, rule = example.choose(req(short, temperature=0.0), "default", premium)
    assert pool == "premium" and rule is not None and rule.text == "tier == premium -> premium"
    assert example.choose(req(short, temperature=0.0), "default", Access(tier="free"))[0] == "trtllm"
    # What the caller says about itself (metadata) is not its tenant's tier.
    assert example.choose(req(short, tier="premium", temperature=0.0), "default")[0] == "trtllm"


def test_a_tenant_only_reaches_its_pools() -> None:
    example = RoutingPolicy.parse(EXAMPLE_ROUTES)
    short = "x" * 400
    only_vllm = Access(pools=frozenset({"vllm", "default"}))
    # The trtllm rule is skipped for it; the model's own pool is still allowed.
    assert example.choose(req(short, temperature=0.0), "default", only_vllm)[0] == "default"
    assert example.choose(req(short, top_p=0.5), "default", only_vllm)[0] == "vllm"
    with pytest.raises(errors.PermissionDenied, match="may not use pool 'cpu'"):
        example.choose(req(short), "cpu", only_vllm)


def test_messages_count_their_contents_and_a_tokenizer_can_count() -> None:
    r = GenerationRequest(
        request_id="r", model="m", messages=(ChatMessage("user", "a" * 4000), ChatMessage("user", "b" * 400))
    )
    assert RoutingPolicy.parse("prompt_tokens > 1000 -> big").choose(r, "d")[0] == "big"
    words = RoutingPolicy.parse("prompt_tokens > 3 -> big", count_tokens=lambda text: len(text.split()))
    assert words.choose(req("one two three"), "d")[0] == "d"
    assert words.choose(req("one two three four"), "d")[0] == "big"


def test_no_rules_means_the_models_pool() -> None:
    policy = RoutingPolicy.parse("")
    assert policy.rules == () and policy.pools == ()
    assert policy.choose(req(), "cpu") == ("cpu", None)


def test_model_priority_and_operators() -> None:
    p = RoutingPolicy.parse("model == m & priority >= 5 -> fast ; model != m -> other")
    assert p.choose(req(), "d")[0] == "d"
    assert p.choose(GenerationRequest(request_id="r", model="m", prompt="x", priority=5), "d")[0] == "fast"
    assert p.choose(GenerationRequest(request_id="r", model="z", prompt="x"), "d")[0] == "other"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("temperature == 0", "expected 'condition & ... -> pool'"),
        ("temperature == 0 ->", "expected 'condition & ... -> pool'"),
        ("temperature 0 -> a", "has no operator"),
        ("temprature == 0 -> a", "unknown field 'temprature'"),
        ("top_p < high -> a", "top_p compares with a number"),
        ("meta.tier < premium -> a", "meta.tier is text; use == or !="),
        ("meta. == x -> a", "unknown field"),
        ("model == -> a", "model needs a value"),
    ],
)
def test_bad_rules_are_rejected_naming_the_rule(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^LLAMAMESH_GATEWAY_ROUTES: routing rule") as exc:
        RoutingPolicy.parse(f"top_p < 0.8 -> vllm; {text}")
    assert message in str(exc.value)


CANARY = "model == m -> vllm=95, vllm-canary=5"


def with_id(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, model="m", prompt="hi")


def test_a_split_sends_each_side_its_weight_and_one_id_always_one_way() -> None:
    policy = RoutingPolicy.parse(CANARY)
    assert policy.pools == ("vllm", "vllm-canary")
    picks = [policy.choose(with_id(f"req-{i}"), "d")[0] for i in range(10_000)]
    assert abs(picks.count("vllm-canary") / 10_000 - 0.05) <= 0.01
    assert picks.count("vllm") + picks.count("vllm-canary") == 10_000
    again = [policy.choose(with_id(f"req-{i}"), "d")[0] for i in range(10_000)]
    assert again == picks  # a retry with the same id lands on the same side
    other = RoutingPolicy.parse("model == m -> a=1, b=1, c=2")
    counts = [other.choose(with_id(f"x{i}"), "d")[0] for i in range(10_000)]
    for pool, share in (("a", 0.25), ("b", 0.25), ("c", 0.5)):
        assert abs(counts.count(pool) / 10_000 - share) <= 0.01, (pool, counts.count(pool))


def test_a_split_keeps_only_the_sides_the_tenant_may_use() -> None:
    policy = RoutingPolicy.parse(CANARY)
    only_stable = Access(pools=frozenset({"vllm", "d"}))
    assert {policy.choose(with_id(f"r{i}"), "d", only_stable)[0] for i in range(500)} == {"vllm"}
    neither = Access(pools=frozenset({"d"}))
    assert policy.choose(with_id("r1"), "d", neither) == ("d", None)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("model == m -> vllm=95", "two pools or more"),
        ("model == m -> vllm=95, canary", "'canary' is not 'pool=weight'"),
        ("model == m -> vllm=95, canary=0", "weight > 0"),
        ("model == m -> vllm=95, canary=-5", "weight > 0"),
        ("model == m -> vllm=1, vllm=2", "twice"),
        ("model == m -> vllm=x, canary=1", "weight > 0"),
        ("model == m -> vllm=inf, canary=1", "weight > 0"),
    ],
)
def test_a_bad_split_is_refused_naming_the_rule(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RoutingPolicy.parse(text)
