"""Prompt normalisation: configured regex rewrites of prompts and chat messages, at the gateway,
before routing and queueing (``Normalizer``; the rule format: ``Normalizer.parse``). Rules rewrite
Generate requests, every BatchGenerate item and Tokenize requests (so a count is that of the text
generation sees); not stop strings, metadata or the breaker's probes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llamamesh import metrics
from llamamesh.types import CHAT_ROLES, ChatMessage, GenerationRequest, affinity_key

SETTING = "LLAMAMESH_GATEWAY_NORMALIZE_RULES"
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
FLAGS = {"a": re.ASCII, "i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}
APPLIES_TO = ("all", "prompt", "messages")
_KEYS = frozenset({"name", "pattern", "replacement", "flags", "applies_to", "roles"})


@dataclass(frozen=True)
class Rule:
    name: str
    regex: re.Pattern[str]
    replacement: str
    applies_to: str = "all"
    # Only messages of these roles (empty: every role).
    roles: frozenset[str] = frozenset()

    def rewrite(self, text: str) -> str:
        return self.regex.sub(self.replacement, text)

    def rewrite_messages(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        out = []
        for m in messages:
            if not self.roles or m.role in self.roles:
                content = self.rewrite(m.content)
                if content != m.content:
                    m = ChatMessage(m.role, content)
            out.append(m)
        return tuple(out)


def _rule(n: int, obj: Any, seen: dict[str, int]) -> Rule:
    """Rule ``n`` (1-based) of the configuration. Raises ValueError naming it."""
    where = f"{SETTING}: rule {n}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f'{where}: "name" is required: 1-64 characters of A-Z a-z 0-9 _ . -')
    where = f"{SETTING}: rule {name!r}"
    if name in seen:
        raise ValueError(f"{where}: duplicate name (rules {seen[name]} and {n})")
    seen[name] = n
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_KEYS))}")
    pattern, repl = obj.get("pattern"), obj.get("replacement")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f'{where}: "pattern" is required (a non-empty string)')
    if not isinstance(repl, str):
        raise ValueError(f'{where}: "replacement" is required (a string, may be empty)')
    letters = obj.get("flags", "")
    if not isinstance(letters, str) or not set(letters) <= set(FLAGS):
        raise ValueError(f'{where}: "flags" must be letters of {"".join(FLAGS)}, got {letters!r}')
    flags = 0
    for c in letters:
        flags |= FLAGS[c]
    applies_to = obj.get("applies_to", "all")
    if applies_to not in APPLIES_TO:
        raise ValueError(f'{where}: "applies_to" must be one of {", ".join(APPLIES_TO)}, got {applies_to!r}')
    roles = obj.get("roles")
    if roles is not None:
        if applies_to != "messages":
            raise ValueError(f'{where}: "roles" needs "applies_to": "messages"')
        if not isinstance(roles, list) or not roles or not all(isinstance(r, str) and r in CHAT_ROLES for r in roles):
            raise ValueError(f'{where}: "roles" must be a non-empty list of {", ".join(sorted(CHAT_ROLES))}')
    try:
        regex = re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"{where}: pattern does not compile: {exc}") from None
    if regex.search("") is not None:
        raise ValueError(f"{where}: pattern matches the empty string")
    try:
        regex.sub(repl, "")  # parses the template: a bad group reference or escape fails here, not later
    except (re.error, IndexError) as exc:
        raise ValueError(f"{where}: replacement is not valid for this pattern: {exc}") from None
    return Rule(name, regex, repl, applies_to, frozenset(roles or ()))


class Normalizer:
    """The configured rules, compiled once. :meth:`apply` never raises.

    Why: engines cache the KV of prompt prefixes they saw, so prompts that carry random bytes (an
    HTML table full of generated ids) defeat the cache even where the text that matters is the same;
    a rule that rewrites those bytes to a constant gives the cache back. An idempotent retry is still
    recognised by what the caller sent."""

    def __init__(self, rules: Sequence[Rule] = (), prefix_chars: int = 0) -> None:
        self.rules = tuple(rules)
        # LLAMAMESH_GATEWAY_AFFINITY_PREFIX_CHARS: a prefix key hashed from the input is hashed again
        # from the rewritten input, so routing sees what the engine's cache sees.
        self.prefix_chars = prefix_chars
        self._prompt = tuple(r for r in self.rules if r.applies_to != "messages")
        self._messages = tuple(r for r in self.rules if r.applies_to != "prompt")

    @classmethod
    def parse(cls, text: str, prefix_chars: int = 0) -> Normalizer:
        r"""Rules from ``LLAMAMESH_GATEWAY_NORMALIZE_RULES``: a JSON list of rules, inline (text
        starting with ``[`` or ``{``) or in a file (any other text is its path; read once, at
        start); empty: none, and requests pass through untouched at no cost. A rule::

            {"name": "html-ids", "pattern": "id=\"[a-z0-9-]+\"", "replacement": "id=\"REDACTED\"",
             "flags": "i", "applies_to": "messages", "roles": ["user"]}

        - ``name`` (required): 1-64 characters of ``A-Z a-z 0-9 _ . -``, unique; the ``rule`` label
          of ``llamamesh_prompt_rewrites_total``;
        - ``pattern`` (required): a Python ``re`` pattern; one that matches the empty text (``x*``,
          ``^``) is refused: it would insert the replacement between every two characters;
        - ``replacement`` (required, may be empty): ``re.sub``'s template (``\1``, ``\g<name>``; a
          literal backslash is ``\\``, in JSON ``"\\\\"``);
        - ``flags``: letters of ``aimsx`` (ASCII, IGNORECASE, MULTILINE, DOTALL, VERBOSE); default none;
        - ``applies_to``: ``all`` (default), ``prompt`` (the request's ``prompt`` only) or
          ``messages`` (the chat messages' contents only);
        - ``roles``: with ``applies_to: messages``, only the messages of these roles (system, user,
          assistant, tool).

        Rules run in their order, each on what the one before left (every match of each:
        ``re.sub``). Anything wrong with them (bad JSON, an unknown key, a missing or duplicate
        name, a pattern or replacement that does not compile) raises ValueError, one line naming
        the rule: the gateway does not start, and a rule cannot fail at request time.

        Rules run on the gateway's event loop with Python's ``re``, which has no timeout: each scans
        at most ``LLAMAMESH_GATEWAY_MAX_PROMPT_CHARS`` characters of a request, but a pattern that
        backtracks catastrophically (nested quantifiers such as ``(a+)+$``) can still stall the
        gateway on a hostile prompt: keep patterns linear (character classes, bounded repeats)."""
        text = text.strip()
        if not text:
            return cls(prefix_chars=prefix_chars)
        source = "the inline value"
        if not text.startswith(("[", "{")):
            source = repr(text)
            try:
                text = Path(text).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"{SETTING}: cannot read {source}: {exc.strerror or exc}") from None
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{SETTING}: {source} is not JSON: {exc}") from None
        if not isinstance(raw, list):
            raise ValueError(f"{SETTING}: expected a JSON list of rules, got {type(raw).__name__}")
        seen: dict[str, int] = {}
        return cls([_rule(n, obj, seen) for n, obj in enumerate(raw, 1)], prefix_chars)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def apply(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its prompt or messages rewritten by every rule in order; ``req`` itself
        when no rule changed anything. Counts each rule that changed the request once
        (``llamamesh_prompt_rewrites_total{rule}``)."""
        if not self.rules:
            return req
        prompt, messages = req.prompt, req.messages
        if prompt is not None:
            for rule in self._prompt:
                new = rule.rewrite(prompt)
                if new != prompt:
                    metrics.PROMPT_REWRITES.labels(rule.name).inc()
                    prompt = new
        if messages:
            for rule in self._messages:
                rewritten = rule.rewrite_messages(messages)
                if rewritten != messages:
                    metrics.PROMPT_REWRITES.labels(rule.name).inc()
                    messages = rewritten
        if prompt == req.prompt and messages == req.messages:
            return req
        key = req.prefix_key
        if key and self.prefix_chars and key == affinity_key(req.prompt, req.messages, self.prefix_chars):
            key = affinity_key(prompt, messages, self.prefix_chars)  # hashed from the input, not the caller's
        return replace(req, prompt=prompt, messages=messages, prefix_key=key)
