"""A BatchGenerateRequest validated whole, before anything is written (``batch_requests``): a bad
item, a duplicate custom_id, an empty, too large or oversized batch is InvalidRequest naming every
bad field; the items become the jobs of the batch (inline items, or a summarisation's documents
through its template).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace

from llamamesh.errors import FieldViolation, InvalidRequest, NotFound
from llamamesh.settings import BatchSettings, GatewaySettings
from llamamesh.types import DEFAULT_TENANT, GenerationRequest, ModelInfo, scoped_id
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services import convert

DEFAULT_TEMPLATE = "Summarise the following document in a few sentences.\n\n{document}"
MAX_CUSTOM_ID = 128
MIN_WINDOW_S = 10


def _requests_of(r: bpb.BatchGenerateRequest, bad: list[FieldViolation]) -> list[tuple[str, str, pb.GenerateRequest]]:
    """(field path, custom_id, GenerateRequest) per item, from inline items or a summarisation."""
    if len(r.items) and r.HasField("summarise"):
        bad.append(FieldViolation("items", "set items or summarise, not both"))
        return []
    if r.HasField("summarise"):
        s = r.summarise
        template = s.template or DEFAULT_TEMPLATE
        if "{document}" not in template:
            bad.append(FieldViolation("summarise.template", "must contain {document}"))
        if s.params.HasField("prompt") or len(s.params.messages):
            bad.append(FieldViolation("summarise.params", "prompt and messages come from the template"))
        out = []
        for i, d in enumerate(s.documents):
            if not d.text.strip():
                bad.append(FieldViolation(f"summarise.documents[{i}].text", "must not be empty"))
            req = pb.GenerateRequest()
            req.CopyFrom(s.params)
            req.ClearField("prompt")  # reported once, on summarise.params
            req.ClearField("request_id")  # ignored: the server names each item's job
            del req.messages[:]
            req.messages.append(pb.ChatMessage(role="user", content=template.replace("{document}", d.text)))
            out.append((f"summarise.documents[{i}]", d.custom_id, req))
        return out
    return [(f"items[{i}]", item.custom_id, _unnamed(item.request)) for i, item in enumerate(r.items)]


def stored_size(r: bpb.BatchGenerateRequest) -> int:
    """The bytes a batch keeps: its request, and a summarisation's template written out for each of
    its documents (what its items hold), counted without writing them out."""
    if not r.HasField("summarise"):
        return r.ByteSize()
    s = r.summarise
    template = s.template or DEFAULT_TEMPLATE
    k = template.count("{document}")
    fixed = len(template.encode()) - k * len("{document}") + s.params.ByteSize()
    return r.ByteSize() + sum(fixed + k * len(d.text.encode()) for d in s.documents)


def _over_bounds(r: bpb.BatchGenerateRequest, b: BatchSettings) -> list[FieldViolation]:
    """What is wrong with the batch's size: more bytes (written out) or items than a batch may have."""
    over = []
    field = "summarise.documents" if r.HasField("summarise") else "items"
    count = len(r.summarise.documents) if r.HasField("summarise") else len(r.items)
    if (size := stored_size(r)) > b.max_bytes:
        what = " with the template written out for each document" if r.HasField("summarise") else ""
        most = f"at most {b.max_bytes} (LLAMAMESH_BATCH_MAX_BYTES)"
        over.append(FieldViolation(field, f"the batch is {size} bytes{what}; {most}"))
    if count > b.max_items:
        over.append(FieldViolation(field, f"{count} items; at most {b.max_items} (LLAMAMESH_BATCH_MAX_ITEMS)"))
    return over


def _unnamed(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """An item's request without the request_id it may carry (ignored: the server names its job)."""
    if not request.request_id:
        return request
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("request_id")
    return out


def _item_violation(path: str, v: FieldViolation) -> FieldViolation:
    """A violation of one item's request, named where the caller wrote it: under the item, or for a
    summarisation, once under summarise.params (the documents share it), except the document itself."""
    if not path.startswith("summarise"):
        return FieldViolation(f"{path}.request.{v.field}", v.description)
    if v.field.startswith("messages"):
        return FieldViolation(f"{path}.text", v.description)
    return FieldViolation(f"summarise.params.{v.field}", v.description)


def batch_requests(
    r: bpb.BatchGenerateRequest,
    gw: GatewaySettings,
    b: BatchSettings,
    models: Sequence[ModelInfo],
    tenant: str = DEFAULT_TENANT,
) -> tuple[str, int, list[tuple[ModelInfo, GenerationRequest]]]:
    """Validate a whole BatchGenerateRequest: (batch id as the caller knows it, completion window,
    items of ``tenant``). Raises InvalidRequest naming every bad field (or NotFound naming the item
    of an unknown model); nothing is written. Item ids (``b~<scoped batch id>~<n>``) meet no caller's id."""
    bad: list[FieldViolation] = []
    batch_id = r.batch_id or uuid.uuid4().hex
    if not convert.REQUEST_ID.match(batch_id):
        bad.append(FieldViolation("batch_id", convert.ID_RULE))
    window = r.completion_window_s if r.HasField("completion_window_s") else b.completion_window_s
    if window < MIN_WINDOW_S:
        bad.append(FieldViolation("completion_window_s", f"at least {MIN_WINDOW_S} seconds"))
    convert.metadata(r.metadata.items(), bad)
    if over := _over_bounds(r, b):  # refused before its items are written out or converted: it costs no more
        raise InvalidRequest(bad + over)
    raw = _requests_of(r, bad)
    if not raw and not bad:
        bad.append(FieldViolation("items", "a batch needs at least one item (items or summarise.documents)"))
    out = _items(raw, gw, models, scoped_id(tenant, batch_id), tenant, bad)
    if bad:
        raise InvalidRequest(bad)
    return batch_id, window, out


def _items(
    raw: list[tuple[str, str, pb.GenerateRequest]],
    gw: GatewaySettings,
    models: Sequence[ModelInfo],
    scoped: str,
    tenant: str,
    bad: list[FieldViolation],
) -> list[tuple[ModelInfo, GenerationRequest]]:
    """Each item validated as a request of the batch ``scoped`` (violations go to ``bad``); an
    unknown model or adapter raises NotFound naming the item."""
    seen: dict[str, str] = {}
    out: list[tuple[ModelInfo, GenerationRequest]] = []
    for n, (path, custom_id, request) in enumerate(raw):
        if not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            bad.append(FieldViolation(f"{path}.custom_id", f"1-{MAX_CUSTOM_ID} characters"))
        elif custom_id in seen:
            bad.append(FieldViolation(f"{path}.custom_id", f"the custom_id of {seen[custom_id]} too"))
        else:
            seen[custom_id] = path
        if len(bad) > 20:  # enough to act on
            break
        try:
            req, model = convert.generate_request(request, gw, models, tools_allowed=False)
        except InvalidRequest as exc:
            bad.extend(v for v in (_item_violation(path, v) for v in exc.violations) if v not in bad)
            continue
        except NotFound as exc:  # an unknown model or adapter: which item names it
            raise type(exc)(f"{path} ({custom_id!r}): {exc.message}") from None
        if out and model.id != out[0][0].id:
            bad.append(FieldViolation(f"{path}.request.model", f"every item must use one model ({out[0][0].id})"))
            continue
        out.append(
            (
                model,
                replace(
                    req,
                    request_id=f"b~{scoped}~{n}",
                    batch_id=scoped,
                    custom_id=custom_id,
                    tenant="" if tenant == DEFAULT_TENANT else tenant,
                ),
            )
        )
    return out
