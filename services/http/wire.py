"""What the HTTP door's routes share on the wire: JSON bodies read into domain errors, and
server-sent events."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from llamamesh import errors


async def read_json(request: web.Request) -> object:
    try:
        return await request.json(loads=json.loads)
    except web.HTTPRequestEntityTooLarge as exc:
        raise errors.InvalidRequest.field(
            "body", f"{exc.text}: at most {request.client_max_size} bytes (LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES)"
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.InvalidRequest.field("body", f"not JSON: {exc}") from exc


async def event(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")
