"""What the HTTP door's routes share on the wire: JSON bodies read into domain errors, and
server-sent events."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llamamesh import errors
from llamamesh.tenants import Identity

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A route's own work, given the request and the caller's identity (the door does the rest).
Work = Callable[[web.Request, Identity], Awaitable[web.StreamResponse]]


async def read_json(request: web.Request, limit: int) -> object:
    """The request's JSON body, at most ``limit`` bytes (``LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES``, as
    a gRPC request), else InvalidRequest naming ``body``."""
    too_big = errors.InvalidRequest.field("body", f"more than {limit} bytes (LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES)")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_big from None
    if len(raw) > limit:
        raise too_big
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # (nesting past Python's stack)
        raise errors.InvalidRequest.field("body", f"not JSON: {exc}") from exc


async def event(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")
