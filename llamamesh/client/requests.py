"""The messages the client sends, built from keywords: ``GenerateRequest`` (with its response
format), ``TokenizeRequest``; and the texts of a response stream's samples."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from llamamesh.v1 import generation_pb2 as pb

Messages = Sequence[tuple[str, str]] | Sequence[pb.ChatMessage]

_FORMATS = ("json_schema", "json_object", "regex", "choice", "grammar")


def response_format(**given: Any) -> pb.ResponseFormat | None:
    """A ResponseFormat from at most one of ``json_schema`` (a dict, or JSON text), ``json_object``
    (True), ``regex``, ``choice`` (a list of strings) or ``grammar`` (EBNF); None if none is set."""
    set_ = {k: v for k, v in given.items() if v is not None and v is not False}
    if len(set_) > 1:
        raise ValueError(f"give one response format, got {sorted(set_)}")
    if not set_:
        return None
    ((kind, value),) = set_.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        return pb.ResponseFormat(choice=pb.Choice(options=list(value)))
    return pb.ResponseFormat(**{kind: value})


def build_request(prompt: str | None = None, messages: Messages | None = None, **fields: Any) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt or (role, content) pairs plus any request fields. A response
    format can be given as one of ``json_schema=`` (a dict or JSON text), ``json_object=True``,
    ``regex=``, ``choice=[...]`` or ``grammar=`` (or as ``response_format=`` itself)."""
    fmt = response_format(**{k: fields.pop(k, None) for k in _FORMATS})
    if fmt is not None:
        fields["response_format"] = fmt
    req = pb.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    if prompt is not None:
        if not isinstance(prompt, str):  # (chat messages passed where the prompt goes)
            raise TypeError(f"prompt: a str, got {type(prompt).__name__}; chat messages go in messages=[...]")
        req.prompt = prompt
    for m in messages or ():
        req.messages.append(m if isinstance(m, pb.ChatMessage) else pb.ChatMessage(role=m[0], content=m[1]))
    return req


def tokenize_request(
    prompt: str | None = None, messages: Messages | None = None, model: str = ""
) -> pb.TokenizeRequest:
    """A TokenizeRequest of a prompt or (role, content) pairs."""
    req = pb.TokenizeRequest(model=model)
    base = build_request(prompt, messages)
    if base.HasField("prompt"):
        req.prompt = base.prompt
    req.messages.extend(base.messages)
    return req


def one_sample(fields: dict[str, Any]) -> None:
    """Refuse ``n`` > 1 where one text is returned."""
    if (fields.get("n") or 1) > 1:
        raise ValueError("complete() returns one text; use complete_n() for n > 1 samples")


def by_sample(messages: Iterable[pb.GenerateResponse], n: int) -> list[str]:
    """The text of each of ``n`` samples (GenerateResponse.sample) from a response stream."""
    texts = [""] * n
    for m in messages:
        texts[m.sample] += m.text
    return texts
