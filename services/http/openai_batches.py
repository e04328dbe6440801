"""OpenAI's batch format and the gateway's batches: an input file (JSONL of ``{custom_id, method,
url, body}``) as a ``BatchGenerateRequest``, a ``Batch`` as OpenAI's batch object, and results as
the lines of the output file (succeeded) and the error file (the rest). The batch itself is the
batch service's (services/batch.py): validated, stored, run and counted exactly as over gRPC."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from llamamesh.errors import FieldViolation, InvalidRequest
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services.http import openai_requests, openai_responses
from services.http.wire import NOT_TEXT, unpaired_surrogate

ENDPOINTS: dict[str, Callable[[object, str], openai_requests.Parsed]] = {
    "/v1/chat/completions": openai_requests.chat,
    "/v1/completions": openai_requests.completion,
}
WINDOW = re.compile(r"^(\d{1,7})([smh])$")
ITEM_FIELD = re.compile(r"^items\[(\d+)\]\.(.+)$")
ITEM = re.compile(r"\bitems\[(\d+)\]")
STATES = {v: bpb.BatchState.Name(v).removeprefix("BATCH_STATE_").lower() for v in bpb.BatchState.values()}
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
UNRUN = {bpb.BATCH_ITEM_STATUS_CANCELLED: "batch_cancelled", bpb.BATCH_ITEM_STATUS_EXPIRED: "batch_expired"}
CHAT = "/v1/chat/completions"


def window_s(text: object) -> int:
    """OpenAI's ``completion_window`` ("24h"; here any "<n>h", "<n>m" or "<n>s") in seconds."""
    match = WINDOW.match(text) if isinstance(text, str) else None
    if match is None:
        raise InvalidRequest.field("completion_window", 'a duration such as "24h"')
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


@dataclass(frozen=True)
class Lines:
    """The items' requests as parsed, and the line of the file each came from."""

    parsed: list[openai_requests.Parsed]
    numbers: list[int]

    def renamed(self, violations: Sequence[FieldViolation]) -> list[FieldViolation]:
        return [FieldViolation(self.rename(v.field), self.described(v.description)) for v in violations]

    def described(self, text: str) -> str:
        """A message of the batch service with each item it names (``items[3]``) as its line (``line 4``)."""

        def line(m: re.Match[str]) -> str:
            i = int(m.group(1))
            return f"line {self.numbers[i]}" if i < len(self.numbers) else m.group(0)

        return ITEM.sub(line, text)

    def rename(self, field: str) -> str:
        """The batch service's field names (``items[3].request.temperature``) as the file's lines
        (``line 4: body.temperature``), and the batch's own as OpenAI's."""
        if field in BATCH_FIELDS:
            return BATCH_FIELDS[field]
        match = ITEM_FIELD.match(field)
        i = int(match.group(1)) if match else -1
        if match is None or i >= len(self.numbers):
            return field
        rest = match.group(2)
        if rest.startswith("request."):
            rest = _in_body(self.parsed[i].caller_field(rest.removeprefix("request.")))
        return f"line {self.numbers[i]}: {rest}"


# The batch service's own fields as OpenAI's Batch API names them (its items are the input file's lines).
BATCH_FIELDS = {"completion_window_s": "completion_window", "items": "input_file_id"}


def _in_body(field: str) -> str:
    """A field of a line's request body as the line names it (``body`` itself when the body is bad)."""
    return field if field == "body" else f"body.{field}"


def batch_request(
    content: bytes, endpoint: str, batch_id: str, window: int, metadata: dict[str, str]
) -> tuple[bpb.BatchGenerateRequest, Lines, list[FieldViolation]]:
    """The input file as the gateway's batch: each well-formed line one item, and what is wrong with
    every malformed line (``line N: ...``). Raises InvalidRequest when the file has no line at all."""
    parse = ENDPOINTS[endpoint]
    req = bpb.BatchGenerateRequest(batch_id=batch_id, completion_window_s=window, metadata=metadata)
    bad: list[FieldViolation] = []
    lines = Lines([], [])
    for n, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            bad.append(FieldViolation(f"line {n}", f"not JSON: {exc}"))
            continue
        if (where := unpaired_surrogate(line, raw)) is not None:
            bad.append(FieldViolation(f"line {n}: {where}" if where else f"line {n}", NOT_TEXT))
            continue
        if not isinstance(line, dict):
            bad.append(FieldViolation(f"line {n}", "an object with custom_id, method, url and body"))
            continue
        if not isinstance(line.get("custom_id"), str):
            bad.append(FieldViolation(f"line {n}: custom_id", "required: a string"))
            continue
        if line.get("method", "POST") != "POST" or line.get("url") != endpoint:
            bad.append(FieldViolation(f"line {n}: url", f"must be POST {endpoint}, the batch's endpoint"))
            continue
        try:
            p = parse(line.get("body"), "")
        except InvalidRequest as exc:
            bad += [FieldViolation(f"line {n}: {_in_body(v.field)}", v.description) for v in exc.violations]
            continue
        if p.stream:
            bad.append(FieldViolation(f"line {n}: body.stream", "a batch's requests are not streamed"))
            continue
        if len(p.prompts) > 1:
            bad.append(FieldViolation(f"line {n}: body.prompt", "one prompt per line"))
            continue
        lines.parsed.append(p)
        lines.numbers.append(n)
        req.items.add(custom_id=line["custom_id"], request=p.request)
    if not req.items and not bad:
        raise InvalidRequest.field("input_file_id", "the file has no request lines")
    return req, lines, bad


def line_of(v: FieldViolation) -> int:
    """The line a violation names (0: the batch's own fields)."""
    match = re.match(r"line (\d+)", v.field)
    return int(match.group(1)) if match else 0


def file_ids(batch_id: str) -> tuple[str, str]:
    """The ids of a batch's output and error files (made from its results when read)."""
    return f"file-output-{batch_id}", f"file-errors-{batch_id}"


def batch_object(b: bpb.Batch, endpoint: str, input_file_id: str) -> dict[str, Any]:
    c = b.counts
    failed = c.errored + c.cancelled + c.expired
    ended = b.state in (
        bpb.BATCH_STATE_COMPLETED,
        bpb.BATCH_STATE_FAILED,
        bpb.BATCH_STATE_EXPIRED,
        bpb.BATCH_STATE_CANCELLED,
    )
    output, errors = file_ids(b.batch_id)
    out: dict[str, Any] = {
        "id": b.batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": f"{b.completion_window_s // 3600}h"
        if b.completion_window_s % 3600 == 0
        else f"{b.completion_window_s}s",
        "status": STATES[b.state],
        "output_file_id": output if ended and c.succeeded else None,
        "error_file_id": errors if ended and failed else None,
        "created_at": b.created_at.seconds,
        "expires_at": b.expires_at.seconds or None,
        "request_counts": {"total": c.total, "completed": c.succeeded, "failed": failed},
        "metadata": dict(b.metadata) or None,
        "usage": {
            "input_tokens": b.usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": b.usage.cached_tokens},
            "output_tokens": b.usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": b.usage.total_tokens,
        },
    }
    for name in TIMES:
        ts = getattr(b, name)
        out[name] = ts.seconds if ts.seconds or ts.nanos else None
    return out


def output_line(r: bpb.BatchResult, endpoint: str, model: str) -> str:
    """A succeeded item as a line of the output file: the response a single request would get,
    created when the result was stored (its cursor is a Redis stream id: milliseconds first), so a
    file reads the same each time."""
    samples = list(r.samples) or [bpb.BatchSample(text=r.text, finish_reason=r.finish_reason, logprobs=r.logprobs)]
    logprobs = any(s.logprobs for s in samples)  # (asked for: one a token)
    answer = openai_responses.Completion(f"{r.batch_id}-{r.custom_id}", endpoint.endswith("chat/completions"), logprobs)
    answer.model = model
    ms = r.cursor.partition("-")[0]
    if ms.isdigit():
        answer.created = int(ms) // 1000
    for i, s in enumerate(samples):
        answer.add(pb.GenerateResponse(text=s.text, finish_reason=s.finish_reason, sample=i, logprobs=s.logprobs))
    answer.usages[0] = r.usage
    body = answer.body()
    response = {"status_code": 200, "request_id": answer.request_id, "body": body}
    return _line({"id": f"batch_req_{r.cursor}", "custom_id": r.custom_id, "response": response, "error": None})


def error_line(r: bpb.BatchResult, endpoint: str) -> str:
    """An item that did not succeed, as a line of the error file: its error response (``param`` the
    field as a request to ``endpoint`` names it), or (never run: cancelled, expired) the error alone."""
    base = {"id": f"batch_req_{r.cursor}", "custom_id": r.custom_id}
    if r.status in UNRUN:
        return _line({**base, "response": None, "error": {"code": UNRUN[r.status], "message": r.error_message}})
    code = grpc.StatusCode.__members__.get(r.error_code, grpc.StatusCode.INTERNAL)
    http, kind = openai_responses.HTTP.get(code, (500, "internal_error"))
    param = (
        openai_requests.CHAT_FIELDS.get(r.error_field, r.error_field) if endpoint == CHAT else r.error_field
    ) or None
    message = r.error_message
    if param and param != r.error_field and message.startswith(f"{r.error_field}:"):  # the field as the line names it
        message = param + message[len(r.error_field) :]
    error = {"message": message, "type": kind, "param": param, "code": (r.error_reason or r.error_code).lower()}
    response = {"status_code": http, "request_id": f"{r.batch_id}-{r.custom_id}", "body": {"error": error}}
    return _line({**base, "response": response, "error": None})


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"
