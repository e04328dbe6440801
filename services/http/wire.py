"""What the HTTP door's routes share on the wire: bodies read at most to their limit, JSON bodies
read into domain errors, server-sent events, and the runner that answers a request head that is not
valid HTTP without echoing it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from llamamesh import errors
from llamamesh.tenants import Identity
from services.http import openai_responses

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A route's own work, given the request and the caller's identity (the door does the rest).
Work = Callable[[web.Request, Identity], Awaitable[web.StreamResponse]]


# A JSON body not received whole in this long (seconds) is refused: a client that stalls its body
# would otherwise hold its connection and its call open for ever.
BODY_S = 30.0


async def read_at_most(read: Callable[[], Awaitable[bytes]], limit: int, too_big: Exception) -> bytes:
    """The chunks ``read`` returns until it returns b"", refused with ``too_big`` as soon as they pass
    ``limit`` bytes: a body sent in chunks (no Content-Length) never holds more than that."""
    chunks, size = [], 0
    while chunk := await read():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: web.Request, limit: int) -> object:
    """The request's JSON body, at most ``limit`` bytes (``LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES``, as
    a gRPC request), else InvalidRequest naming ``body``."""
    too_big = errors.InvalidRequest.field("body", f"more than {limit} bytes (LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES)")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        raw = await asyncio.wait_for(read_at_most(request.content.readany, limit, too_big), BODY_S)
    except asyncio.TimeoutError:
        raise errors.InvalidRequest.field("body", f"not received whole within {BODY_S:g} s") from None
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


class Runner(web.AppRunner):
    """aiohttp's runner, but a request head that is not valid HTTP is answered in OpenAI's shape
    naming only the parser's error kind: aiohttp's own answer quotes the bytes its parser stopped
    at, an authorization header's API key among them, to whoever sent them or a proxy's log."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # (aiohttp takes no handler class: the server makes one per connection)
        return server


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Handler(RequestHandler):
    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        self.logger.info("http_request_refused %s (status %s)", type(exc).__name__, exc.code)
        http, body, _ = openai_responses.error(
            errors.InvalidRequest.field("request", f"not valid HTTP ({type(exc).__name__})")
        )
        answer = web.json_response(body, status=http)
        answer.force_close()
        return answer
