"""What the HTTP door's routes share on the wire: JSON bodies read into domain errors, and
server-sent events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llamamesh import errors
from llamamesh.tenants import Identity

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A route's own work, given the request and the caller's identity (the door does the rest).
Work = Callable[[web.Request, Identity], Awaitable[web.StreamResponse]]


# A JSON body not received whole in this long (seconds) is refused: a client that stalls its body
# would otherwise hold its connection and its call open for ever.
BODY_S = 30.0


async def read_json(request: web.Request, limit: int) -> object:
    """The request's JSON body, at most ``limit`` bytes (``LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES``, as
    a gRPC request), else InvalidRequest naming ``body``."""
    too_big = errors.InvalidRequest.field("body", f"more than {limit} bytes (LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES)")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        raw = await asyncio.wait_for(request.read(), BODY_S)
    except web.HTTPRequestEntityTooLarge:
        raise too_big from None
    except asyncio.TimeoutError:
        raise errors.InvalidRequest.field("body", f"not received whole within {BODY_S:g} s") from None
    if len(raw) > limit:
        raise too_big
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # (nesting past Python's stack)
        raise errors.InvalidRequest.field("body", f"not JSON: {exc}") from exc
    if (where := unpaired_surrogate(body, raw)) is not None:
        raise errors.InvalidRequest.field(where or "body", NOT_TEXT)
    return body


NOT_TEXT = "not text: an unpaired UTF-16 surrogate (U+D800-U+DFFF)"


def unpaired_surrogate(value: object, raw: bytes) -> str | None:
    """Where JSON parsed from ``raw`` holds a string that is not text (a lone ``\\ud800`` escape, or
    its UTF-8 form, which Python's json lets through): the field's path (``messages[0].content``,
    "" for the whole value), else None. Such a string cannot be encoded, so it is refused here."""
    if b"\\u" not in raw and b"\xed" not in raw:  # neither form is in the body: the common case
        return None
    todo: list[tuple[str, object]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str) and not _text(v):
            return path
        if isinstance(v, dict):
            if not all(_text(key) for key in v):
                return path  # a key that is not text is named by the object holding it
            todo.extend((f"{path}.{key}" if path else key, item) for key, item in v.items())
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


async def event(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")
