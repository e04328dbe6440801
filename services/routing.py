"""The routing policy (``RoutingPolicy``): which backend pool a request goes to, by the rules of
``LLAMAMESH_GATEWAY_ROUTES`` (their syntax: ``RoutingPolicy.parse``), among the pools the caller's
tenant may use. The breaker-driven fallback (services/backends.py) then applies to the pool chosen
here.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamamesh import errors
from llamamesh.types import GenerationRequest

EXAMPLE_ROUTES = (
    "tier == premium -> premium; "
    "prompt_tokens < 1024 & temperature == 0 -> trtllm; "
    "prompt_tokens > 8192 -> vllm; "
    "top_p < 0.8 -> vllm"
)

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "!=": operator.ne,
    "==": operator.eq,
    "<": operator.lt,
    ">": operator.gt,
}
_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1.0, "min_p": 0.0}
_NUMERIC = ("prompt_tokens", "temperature", "top_p", "top_k", "min_p", "max_tokens", "priority")


@dataclass(frozen=True)
class Access:
    """What the caller's tenant may use: its tier (the routing field ``tier``) and its pools
    (empty: every pool)."""

    tier: str = ""
    pools: frozenset[str] = frozenset()

    def allows(self, pool: str) -> bool:
        return not self.pools or pool in self.pools


@dataclass(frozen=True)
class Condition:
    field: str
    op: str
    value: float | str

    def holds(self, facts: dict[str, float | str], meta: dict[str, str]) -> bool:
        if self.field.startswith("meta."):
            actual: float | str = meta.get(self.field[5:], "")
        else:
            actual = facts[self.field]
        return _OPS[self.op](actual, self.value)


@dataclass(frozen=True)
class Rule:
    conditions: tuple[Condition, ...]
    pool: str
    text: str
    # A weighted split (a canary): (pool, weight) pairs, ``pool`` the first; empty: all to ``pool``.
    split: tuple[tuple[str, float], ...] = ()

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(p for p, _w in self.split) if self.split else (self.pool,)

    def target(self, request_id: str, access: Access) -> str | None:
        """The pool for ``request_id`` among the ones ``access`` allows (None: none): the split's
        side is chosen by a hash of the id, so one id (a retry) always lands on the same side."""
        sides = [(p, w) for p, w in self.split or ((self.pool, 1.0),) if access.allows(p)]
        if not sides:
            return None
        if len(sides) == 1:
            return sides[0][0]
        total = sum(w for _p, w in sides)
        at = bucket(request_id) * total
        for p, w in sides:
            at -= w
            if at < 0:
                return p
        return sides[-1][0]


def bucket(request_id: str) -> float:
    """A number in [0, 1) fixed by ``request_id``, the same in every gateway process and release."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _rule(raw: str) -> Rule:
    """One rule, ``cond & cond ... -> target``; ValueError naming it."""
    conds, arrow, target = raw.partition("->")
    if not arrow or not target.strip() or not conds.strip():
        raise ValueError(f"routing rule {raw!r}: expected 'condition & ... -> pool'")
    pool, split = _split(target.strip(), raw)
    conditions = tuple(_condition(c.strip(), raw) for c in conds.split("&"))
    return Rule(conditions, pool, " ".join(raw.split()), split)


def _split(target: str, rule: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """``pool`` or ``pool=weight, pool=weight, ...`` (a split by weight; at least two pools)."""
    if "=" not in target and "," not in target:
        return target, ()
    sides: list[tuple[str, float]] = []
    for part in (x.strip() for x in target.split(",")):
        pool, eq, weight = part.partition("=")
        pool = pool.strip()
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not eq or not pool or not math.isfinite(w) or w <= 0:
            raise ValueError(f"routing rule {rule!r}: {part!r} is not 'pool=weight' with a weight > 0")
        if pool in (p for p, _w in sides):
            raise ValueError(f"routing rule {rule!r}: pool {pool!r} twice in one split")
        sides.append((pool, w))
    if len(sides) < 2:
        raise ValueError(f"routing rule {rule!r}: a split names two pools or more ('a=95, b=5')")
    return sides[0][0], tuple(sides)


def _condition(text: str, rule: str) -> Condition:
    for op in _OPS:  # two-character operators first
        field, sep, value = text.partition(op)
        if sep:
            break
    else:
        raise ValueError(f"routing rule {rule!r}: {text!r} has no operator (< <= > >= == !=)")
    field, value = field.strip(), value.strip()
    if field in _NUMERIC:
        try:
            return Condition(field, op, float(value))
        except ValueError:
            raise ValueError(f"routing rule {rule!r}: {field} compares with a number, got {value!r}") from None
    if field in ("model", "tier") or (field.startswith("meta.") and len(field) > 5):
        if op not in ("==", "!="):
            raise ValueError(f"routing rule {rule!r}: {field} is text; use == or !=")
        if not value:
            raise ValueError(f"routing rule {rule!r}: {field} needs a value")
        return Condition(field, op, value)
    known = ", ".join([*_NUMERIC, "model", "tier", "meta.<key>"])
    raise ValueError(f"routing rule {rule!r}: unknown field {field!r} (known: {known})")


class RoutingPolicy:
    def __init__(self, rules: tuple[Rule, ...], count_tokens: Callable[[str], int] | None = None) -> None:
        self.rules = rules
        self._count = count_tokens

    @classmethod
    def parse(cls, text: str, count_tokens: Callable[[str], int] | None = None) -> RoutingPolicy:
        """Rules from ``LLAMAMESH_GATEWAY_ROUTES``; ValueError naming the bad rule.

        ``LLAMAMESH_GATEWAY_ROUTES`` holds rules separated by ``;``, tried in order; the first whose
        conditions all hold names the pool, otherwise the request goes to its model's pool. A rule is
        ``cond & cond ... -> pool``; a condition is ``field op value`` with ``op`` one of
        ``< <= > >= == !=``. Fields:

        - ``prompt_tokens``: the prompt's length in tokens, counted with the model's tokenizer when the
          gateway has one (``LLAMAMESH_GATEWAY_TOKENIZER``, a ``tokenizer.json``), else estimated as
          UTF-8 bytes / 4 (rounded up; English text runs 3.5 to 4.5 bytes a token);
        - ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens``, ``priority``, ``model``;
        - ``tier``: the caller's tenant's tier (``LLAMAMESH_LIMITS_TIER`` or the tenants file), never
          what the caller says about itself;
        - ``meta.<key>``: the request's ``metadata[key]`` (caller-chosen labels: never route privilege
          by them).

        A sampling field the request leaves unset takes the service's documented default (temperature 1,
        top_p 1, top_k -1, min_p 0); a missing ``meta.`` key is the empty string. Numbers compare as numbers,
        anything else as text (only ``==`` and ``!=``).

        A rule's target may be a split by weight, a canary: ``model == llama -> vllm=95, vllm-canary=5``
        sends 5 % of the model's requests to the pool ``vllm-canary``. The side is chosen by a hash of the
        request id, so a retry with the same id (and a batch item, whose id is fixed) lands on the same side
        in every gateway process; the pools' metrics (``pool`` label) compare the two.

        A rule naming a pool the tenant may not use (``LLAMAMESH_LIMITS_POOLS``) is skipped (a split keeps
        the sides it may use); a request whose own model's pool is not allowed is refused (PERMISSION_DENIED).

        The shipped example (:data:`EXAMPLE_ROUTES`) sends a premium tenant to its dedicated pool first (it
        pays for isolation, whatever it asks), short greedy prompts to TensorRT-LLM, and very long prompts or
        narrow nucleus sampling to vLLM."""
        try:
            rules = [_rule(raw) for raw in (r.strip() for r in text.split(";")) if raw]
        except ValueError as exc:
            raise ValueError(f"LLAMAMESH_GATEWAY_ROUTES: {exc}") from exc
        return cls(tuple(rules), count_tokens)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for r in self.rules for p in r.pools))

    def prompt_tokens(self, req: GenerationRequest) -> int:
        text = req.prompt if req.prompt is not None else "\n".join(m.content for m in req.messages or ())
        if self._count is not None:
            return self._count(text)
        return math.ceil(len(text.encode()) / 4)

    def choose(
        self, req: GenerationRequest, default_pool: str, access: Access | None = None
    ) -> tuple[str, Rule | None]:
        """The pool for ``req`` and the rule that chose it (None: the model's own pool), among the
        pools ``access`` allows. Raises PermissionDenied when it allows none that fits."""
        access = access or _ALL
        if not self.rules:
            return self._allowed(default_pool, access), None
        s = req.sampling
        facts: dict[str, float | str] = {
            "temperature": s.temperature if s.temperature is not None else _DEFAULTS["temperature"],
            "top_p": s.top_p if s.top_p is not None else _DEFAULTS["top_p"],
            "top_k": s.top_k if s.top_k is not None else _DEFAULTS["top_k"],
            "min_p": s.min_p if s.min_p is not None else _DEFAULTS["min_p"],
            "max_tokens": s.max_tokens or 0,
            "priority": req.priority,
            "model": req.model,
            "tier": access.tier,
        }
        if any(c.field == "prompt_tokens" for r in self.rules for c in r.conditions):
            facts["prompt_tokens"] = self.prompt_tokens(req)
        meta = dict(req.metadata)
        for rule in self.rules:
            if all(c.holds(facts, meta) for c in rule.conditions):
                pool = rule.target(req.request_id, access)
                if pool is not None:
                    return pool, rule
        return self._allowed(default_pool, access), None

    @staticmethod
    def _allowed(pool: str, access: Access) -> str:
        if not access.allows(pool):
            raise errors.PermissionDenied(
                f"this tenant may not use pool {pool!r} (its pools: {', '.join(sorted(access.pools))}; "
                "LLAMAMESH_LIMITS_POOLS)"
            )
        return pool


_ALL = Access()


def tokenizer_counter(path: str) -> Callable[[str], int]:
    """A prompt-token counter from a ``tokenizer.json`` (the ``tokenizers`` library, imported here
    only when configured). Raises ValueError if it cannot be loaded."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ValueError("LLAMAMESH_GATEWAY_TOKENIZER needs the 'tokenizers' package") from exc
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # the library raises its own Exception subclass
        raise ValueError(f"LLAMAMESH_GATEWAY_TOKENIZER: cannot load {path!r}: {exc}") from exc
    return lambda text: len(tok.encode(text).ids)
