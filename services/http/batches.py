"""OpenAI's Files and Batches endpoints on the HTTP door, over the gateway's own batch service:

- ``POST /v1/files`` (multipart, ``purpose=batch``), ``GET /v1/files/{id}``,
  ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``: uploads kept by the file store
  (llamamesh/queue/files.py), each at most ``LLAMAMESH_BATCH_MAX_BYTES``, its owner's only.
- ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``,
  ``GET /v1/batches`` (``limit``, ``after``): the input file's lines become one
  ``BatchGenerateRequest`` (services/http/openai_batches.py) submitted, read and cancelled through
  the batch service (services/batch.py) as a gRPC caller would.
- A batch's output and error files are its results, written in OpenAI's line format when read.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from llamamesh import errors
from llamamesh.queue.gateway_stores import FileStore
from llamamesh.tenants import Identity
from llamamesh.types import StoredFile, scoped_id
from llamamesh.v1 import batch_pb2 as bpb
from services.batch import BatchServicer
from services.http import openai_batches
from services.http.wire import Handler, Work, read_at_most, read_json

Route = Callable[[str, Work], Handler]
FILE_ID = "file-"
BATCH_ID = "batch_"
MAX_FILES_LISTED = 10000  # GET /v1/files: the most one page lists, and its default (as OpenAI's)
FILES_FULL_RETRY_S = 60.0  # a tenant whose files hold its max_batch_bytes: after this, or a deletion
MAX_FILENAME = 255  # an uploaded file's name: at most this many printable characters
MAX_PURPOSE = 64  # an upload's purpose field (bytes; "batch" is the one purpose)


class BatchRoutes:
    def __init__(self, batches: BatchServicer, files: FileStore, max_bytes: int, retention_s: float) -> None:
        self._batches = batches
        self._files = files
        self.max_bytes = max_bytes
        self._retention_s = retention_s

    def add_routes(self, app: web.Application, route: Route) -> None:
        r = app.router
        r.add_post("/v1/files", route("UploadFile", self._upload))
        r.add_get("/v1/files", route("ListFiles", self._list_files))
        r.add_get("/v1/files/{id}", route("GetFile", self._file))
        r.add_get("/v1/files/{id}/content", route("GetFileContent", self._content))
        r.add_delete("/v1/files/{id}", route("DeleteFile", self._delete))
        r.add_post("/v1/batches", route("CreateBatch", self._create))
        r.add_get("/v1/batches", route("ListBatches", self._list))
        r.add_get("/v1/batches/{id}", route("GetBatch", self._get))
        r.add_post("/v1/batches/{id}/cancel", route("CancelBatch", self._cancel))

    # --- files

    async def _upload(self, request: web.Request, who: Identity) -> web.StreamResponse:
        purpose, filename, content = await self._form(request)
        if purpose != "batch":
            raise errors.InvalidRequest.field("purpose", "must be batch")
        stored = StoredFile(FILE_ID + uuid.uuid4().hex, who.tenant, filename, purpose, len(content), time.time())
        most = who.limits.max_batch_bytes
        held = await self._files.put(stored, content, most)
        if held is not None:
            raise errors.RateLimited(
                f"tenant {who.tenant!r} keeps {held} bytes of uploaded files; {len(content)} more would pass its "
                f"limit of {most} (LLAMAMESH_LIMITS_MAX_BATCH_BYTES): delete files it no longer needs",
                retry_after_s=FILES_FULL_RETRY_S,
            )
        return web.json_response(_file_object(stored))

    async def _list_files(self, request: web.Request, who: Identity) -> web.StreamResponse:
        """The caller's uploaded files: ``limit`` (1-10000, default 10000) after the file ``after``,
        ``order`` desc (newest first, the default) or asc, of ``purpose`` (all are batch)."""
        q = request.query
        limit = _limit(q.get("limit", str(MAX_FILES_LISTED)), MAX_FILES_LISTED)
        if (order := q.get("order", "desc")) not in ("asc", "desc"):
            raise errors.InvalidRequest.field("order", "asc or desc")
        found = await self._files.owned(who.tenant, limit + 1, q.get("after", ""), newest_first=order == "desc")
        purpose = q.get("purpose", "")
        data = [_file_object(f) for f in found[:limit] if not purpose or f.purpose == purpose]
        page = {"object": "list", "data": data, "first_id": data[0]["id"] if data else None}
        return web.json_response({**page, "last_id": data[-1]["id"] if data else None, "has_more": len(found) > limit})

    async def _form(self, request: web.Request) -> tuple[str, str, bytes]:
        if not request.content_type.startswith("multipart/"):
            raise errors.InvalidRequest.field("file", "upload the file as multipart/form-data with purpose")
        purpose, filename, content = "", "", None
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    too_big = errors.InvalidRequest.field("purpose", f"more than {MAX_PURPOSE} bytes")
                    raw = await read_at_most(_chunks_of(part), MAX_PURPOSE, too_big)
                    purpose = raw.decode(errors="replace").strip()  # (not "batch": refused naming purpose)
                elif part.name == "file":
                    filename = part.filename or "input.jsonl"
                    too_big = errors.InvalidRequest.field(
                        "file", f"more than {self.max_bytes} bytes (LLAMAMESH_BATCH_MAX_BYTES)"
                    )
                    content = await read_at_most(_chunks_of(part), self.max_bytes, too_big)
        except (ValueError, LookupError, HttpProcessingError) as exc:  # aiohttp's: not multipart, cut short
            raise errors.InvalidRequest.field("file", f"not a whole multipart/form-data body: {exc}") from exc
        if content is None:
            raise errors.InvalidRequest.field("file", "required")
        if len(filename) > MAX_FILENAME or not filename.isprintable():
            raise errors.InvalidRequest.field("file", f"its filename: at most {MAX_FILENAME} printable characters")
        return purpose, filename, content

    async def _file(self, request: web.Request, who: Identity) -> web.StreamResponse:
        file_id = request.match_info["id"]
        made = await self._made(file_id, who)
        if made is not None:
            batch, endpoint, errors_file = made
            size = sum([len(line.encode()) async for line in self._lines(batch, endpoint, errors_file, who)])
            name = f"{batch.batch_id}_{'error' if errors_file else 'output'}.jsonl"
            made_file = StoredFile(file_id, who.tenant, name, "batch_output", size, float(batch.created_at.seconds))
            return web.json_response(_file_object(made_file))
        return web.json_response(_file_object(await self._uploaded(file_id, who)))

    async def _content(self, request: web.Request, who: Identity) -> web.StreamResponse:
        file_id = request.match_info["id"]
        made = await self._made(file_id, who)
        if made is None:
            await self._uploaded(file_id, who)
            content = await self._files.content(who.tenant, file_id)
            if content is None:
                raise errors.NotFound(f"no file {file_id!r}")
            return web.Response(body=content, content_type="application/octet-stream")
        batch, endpoint, errors_file = made
        out = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
        await out.prepare(request)
        async for line in self._lines(batch, endpoint, errors_file, who):
            await out.write(line.encode())
        await out.write_eof()
        return out

    async def _delete(self, request: web.Request, who: Identity) -> web.StreamResponse:
        file_id = request.match_info["id"]
        if not await self._files.delete(who.tenant, file_id):
            raise errors.NotFound(f"no file {file_id!r}")
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def _uploaded(self, file_id: str, who: Identity) -> StoredFile:
        found = await self._files.get(who.tenant, file_id) if file_id.startswith(FILE_ID) else None
        if found is None:
            raise errors.NotFound(f"no file {file_id!r}")
        return found

    async def _made(self, file_id: str, who: Identity) -> tuple[bpb.Batch, str, bool] | None:
        """A batch's output or error file: (the batch, its endpoint, whether the error file)."""
        for prefix, errors_file in (("file-output-", False), ("file-errors-", True)):
            if file_id.startswith(prefix):
                batch, link = await self._batch(file_id.removeprefix(prefix), who)
                return batch, link["endpoint"], errors_file
        return None

    async def _lines(self, batch: bpb.Batch, endpoint: str, errors_file: bool, who: Identity) -> AsyncIterator[str]:
        results = self._batches.results(batch.batch_id, who, "", follow=False)
        async with aclosing(results) as stream:
            async for r in stream:
                succeeded = r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED
                if succeeded and not errors_file:
                    yield openai_batches.output_line(r, endpoint, batch.model)
                elif not succeeded and errors_file:
                    yield openai_batches.error_line(r, endpoint)

    # --- batches

    async def _create(self, request: web.Request, who: Identity) -> web.StreamResponse:
        body = await read_json(request, 1024 * 1024)  # the batch's own fields; its requests are in the file
        if not isinstance(body, dict):
            raise errors.InvalidRequest.field("body", "must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in openai_batches.ENDPOINTS:
            raise errors.InvalidRequest.field("endpoint", f"one of {sorted(openai_batches.ENDPOINTS)}")
        window = openai_batches.window_s(body.get("completion_window", "24h"))
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise errors.InvalidRequest.field("metadata", "an object of strings")
        input_id = body.get("input_file_id")
        if not isinstance(input_id, str) or not input_id:
            raise errors.InvalidRequest.field("input_file_id", "required: the id of a file uploaded for purpose batch")
        file = await self._uploaded(input_id, who)
        content = await self._files.content(who.tenant, file.file_id) or b""
        batch_id = BATCH_ID + uuid.uuid4().hex
        # Reading up to 50 000 lines takes seconds: off the event loop (other calls' streams).
        parse = openai_batches.batch_request
        req, lines, bad = await asyncio.to_thread(parse, content, endpoint, batch_id, window, metadata)
        if bad:  # the batch service's checks of the other lines too: every bad line in one answer
            found = await asyncio.to_thread(self._batches.violations, req, who) if req.items else []
            raise errors.InvalidRequest(sorted(bad + lines.renamed(found), key=openai_batches.line_of))
        try:
            batch = await self._batches.submit(req, who)
        except errors.InvalidRequest as exc:  # the batch service's names, as the file's lines
            raise errors.InvalidRequest(lines.renamed(exc.violations)) from None
        except (errors.NotFound, errors.PermissionDenied) as exc:  # a model, adapter or priority: its line
            raise type(exc)(lines.described(exc.message)) from None
        link = {"endpoint": endpoint, "input_file_id": input_id}
        await self._files.link(scoped_id(who.tenant, batch_id), link, window + self._retention_s + 3600)
        return web.json_response(openai_batches.batch_object(batch, endpoint, input_id))

    async def _batch(self, batch_id: str, who: Identity) -> tuple[bpb.Batch, dict[str, str]]:
        """The caller's batch made through this door (another's, or one made over gRPC: NotFound)."""
        if not batch_id.startswith(BATCH_ID):
            raise errors.NotFound(f"no batch {batch_id!r}")
        batch = await self._batches.get(batch_id, who)
        link = await self._files.linked(scoped_id(who.tenant, batch_id))
        if not link:
            raise errors.NotFound(f"no batch {batch_id!r}")
        return batch, link

    async def _get(self, request: web.Request, who: Identity) -> web.StreamResponse:
        batch, link = await self._batch(request.match_info["id"], who)
        return web.json_response(openai_batches.batch_object(batch, link["endpoint"], link["input_file_id"]))

    async def _cancel(self, request: web.Request, who: Identity) -> web.StreamResponse:
        batch, link = await self._batch(request.match_info["id"], who)
        cancelled = await self._batches.cancel(batch.batch_id, who)
        return web.json_response(openai_batches.batch_object(cancelled, link["endpoint"], link["input_file_id"]))

    async def _list(self, request: web.Request, who: Identity) -> web.StreamResponse:
        """The caller's batches made through this door, newest first: ``limit`` (1-100, default 20)
        after the batch ``after``."""
        limit = _limit(request.query.get("limit", "20"), 100)
        token = ""
        if after := request.query.get("after", ""):
            before, _ = await self._batch(after, who)
            token = repr(before.created_at.ToNanoseconds() / 1e9)
        data: list[dict[str, Any]] = []
        more = False
        while not more:  # pages of all the tenant's batches, until one past ``limit`` of this door's
            page = await self._batches.page(who, 100, token)
            for b in page.batches:
                link = await self._files.linked(scoped_id(who.tenant, b.batch_id)) if b.batch_id != after else None
                if link and len(data) == limit:
                    more = True
                    break
                if link:  # (batches made over gRPC have no OpenAI form)
                    data.append(openai_batches.batch_object(b, link["endpoint"], link["input_file_id"]))
            if not page.next_page_token:
                break
            token = page.next_page_token
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return web.json_response({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


def _limit(text: str, most: int) -> int:
    """A listing's ``limit`` query parameter, from 1 to ``most``."""
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise errors.InvalidRequest.field("limit", f"an integer from 1 to {most}")
    return limit


def _file_object(f: StoredFile) -> dict[str, Any]:
    return {
        "id": f.file_id,
        "object": "file",
        "bytes": f.size,
        "created_at": int(f.created_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "expires_at": None,
    }


def _chunks_of(part: BodyPartReader) -> Callable[[], Awaitable[bytes]]:
    return lambda: part.read_chunk(65536)
