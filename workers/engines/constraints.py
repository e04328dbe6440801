"""Response constraints (GenerateRequest.response_format) as each engine takes them: compiled with
xgrammar for the CPU engine (:class:`Grammars`), as vLLM's (:func:`vllm_structured`) and
TensorRT-LLM's (:func:`trtllm_guided`) keyword arguments for the GPU engines. A constraint an engine
cannot compile is InvalidRequest naming the public field (``response_format.json_schema``, ...).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

from llamamesh.errors import InvalidRequest, Unavailable
from llamamesh.types import ConstraintKind, GenerationRequest, ResponseConstraint

# How the GPU libraries word a constraint they cannot compile (vLLM's structured-output validation,
# xgrammar's and llguidance's parsers).
_CONSTRAINT_ERROR = re.compile(r"structured|grammar|schema|regex|json|choice|xgrammar|guidance|ebnf", re.I)


def choice_grammar(options: Iterable[str]) -> str:
    """An EBNF (GBNF) grammar whose language is exactly ``options``: JSON string escapes are GBNF's."""
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


def vllm_structured(c: ResponseConstraint) -> dict[str, Any]:
    """``vllm.sampling_params.StructuredOutputsParams`` keyword arguments (0.26.0: ``json``,
    ``json_object``, ``regex``, ``choice``, ``grammar``, ``disable_any_whitespace``)."""
    if c.kind is ConstraintKind.JSON_SCHEMA:
        return {"json": c.text, "disable_any_whitespace": True}
    if c.kind is ConstraintKind.JSON_OBJECT:
        return {"json_object": True, "disable_any_whitespace": True}
    if c.kind is ConstraintKind.CHOICE:
        return {"choice": list(c.options)}
    return {c.kind.value: c.text}


def trtllm_guided(c: ResponseConstraint) -> dict[str, Any]:
    """``tensorrt_llm.llmapi.GuidedDecodingParams`` keyword arguments (its documented ``json``,
    ``json_object``, ``regex``, ``grammar``; no choice, so a choice becomes a grammar). Written from
    the documentation; never run on TensorRT-LLM (see trtllm.py)."""
    if c.kind is ConstraintKind.JSON_SCHEMA:
        return {"json": c.text}
    if c.kind is ConstraintKind.JSON_OBJECT:
        return {"json_object": True}
    if c.kind is ConstraintKind.CHOICE:
        return {"grammar": choice_grammar(c.options)}
    return {c.kind.value: c.text}


def library_constraint(request: GenerationRequest, engine: str) -> ResponseConstraint | None:
    """The request's constraint for a GPU library, which compiles it from the first generated token:
    a resumed request (mid-stream failover) would restart the grammar after the tokens already sent,
    so it is refused as Unavailable (the CPU engine feeds them through its grammar instead)."""
    c = request.sampling.constraint
    if c is not None and request.resume_token_ids:
        raise Unavailable(
            f"{engine} cannot resume a request with a response_format mid-stream: its grammar "
            "would start again after the tokens already sent"
        )
    return c


def check_grammar(c: ResponseConstraint) -> None:
    """Parse ``c`` with xgrammar, without a tokenizer (milliseconds), for a library that compiles it only
    inside its engine loop, where a failure is no bad request: InvalidRequest naming its field. Without
    xgrammar nothing is checked here."""
    try:
        import xgrammar as xgr
    except ImportError:
        return
    try:
        if c.kind is ConstraintKind.JSON_SCHEMA:
            xgr.Grammar.from_json_schema(c.text)
        elif c.kind is ConstraintKind.REGEX:
            xgr.Grammar.from_regex(c.text)
        elif c.kind is ConstraintKind.CHOICE:
            xgr.Grammar.from_ebnf(choice_grammar(c.options))
        elif c.kind is ConstraintKind.GRAMMAR:
            xgr.Grammar.from_ebnf(c.text)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequest.field(c.field, f"the engine cannot compile it: {_reason(exc)}") from exc


def constraint_error(message: str, c: ResponseConstraint | None) -> InvalidRequest | None:
    """A library's validation error about the constraint, naming its field; None if it is not one."""
    if c is not None and _CONSTRAINT_ERROR.search(message):
        return InvalidRequest.field(c.field, f"the engine cannot compile it: {message}")
    return None


def _reason(exc: BaseException) -> str:
    """xgrammar's error without its C++ source location: ``[time] file.cc:123: what`` -> ``what``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


# What compiles constraints for one tokenizer: (tokenizer, vocab_size, stop token ids) -> Grammars.
GrammarsFor = Callable[[Any, int, Iterable[int]], "Grammars"]


class Grammars:
    """xgrammar compilation for one tokenizer (compiled grammars cached by xgrammar), from any thread
    (xgrammar's compiler is thread-safe). xgrammar is imported on the first constrained request.
    Each sequence of the CPU engine gets a ``GrammarMatcher``, whose token bitmask is applied to its
    logits (workers/engines/sampling.py). JSON is compiled without free whitespace between tokens: a
    small model given the choice pads with whitespace until max_tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def matcher(self, c: ResponseConstraint) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` for ``c``; InvalidRequest naming its field if xgrammar
        cannot compile it."""
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            compiler = self._compiler
        try:
            if c.kind is ConstraintKind.JSON_SCHEMA:
                compiled = compiler.compile_json_schema(c.text, any_whitespace=False)
            elif c.kind is ConstraintKind.JSON_OBJECT:
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif c.kind is ConstraintKind.REGEX:
                compiled = compiler.compile_regex(c.text)
            elif c.kind is ConstraintKind.CHOICE:
                compiled = compiler.compile_grammar(choice_grammar(c.options))
            else:
                compiled = compiler.compile_grammar(c.text)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequest.field(c.field, f"the engine cannot compile it: {_reason(exc)}") from exc
        return xgr.GrammarMatcher(compiled)
