"""The JSONL files of ``llamamesh batch``: the items read from a file, the results written to one.

Both formats are tabled in docs/api.md ("BatchService").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from google.protobuf import json_format

from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb

# An item the gateway names (``items[3].request.temperature``, ``summarise.documents[0]``).
ITEM = re.compile(r"\b(?:items|summarise\.documents)\[(\d+)\](?:\.request)?(?:\.([\w.\[\]]+))?")


def line_names(lines: Sequence[str]) -> Callable[[str], str]:
    """A renamer of the gateway's messages about the batch read from ``lines``: each item it names
    as the file's line (``line 4: temperature``; blank lines count, as an editor numbers them)."""
    numbers = [n for n, line in enumerate(lines, 1) if line.strip()]

    def named(m: re.Match[str]) -> str:
        i, field = int(m.group(1)), m.group(2)
        if i >= len(numbers):
            return m.group(0)
        return f"line {numbers[i]}" + (f": {field}" if field else "")

    return lambda text: ITEM.sub(named, text)


def read_lines(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line, one JSON object each; ValueError naming the line."""
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as exc:  # (nested too deep: RecursionError)
                raise ValueError(f"line {n}: not JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"line {n}: expected a JSON object")
            yield n, obj


def _custom_id(n: int, obj: dict[str, Any]) -> str:
    """A line's ``custom_id``: a string (the gateway checks it is there and unique)."""
    value = obj.get("custom_id", "")
    if not isinstance(value, str):
        raise ValueError(f'line {n}: "custom_id" must be a string')
    return value


def _only(n: int, obj: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse a line with a key the format has not (a misspelt one would be ignored otherwise)."""
    extra = sorted(set(obj) - set(keys))
    if extra:
        raise ValueError(f"line {n}: unknown key {extra[0]!r}: a line holds {', '.join(keys)}")


def summarise_request(lines: Iterable[str], params: pb.GenerateRequest, template: str = "") -> bpb.Summarise:
    """The documents of ``--summarise``, one ``{"custom_id": "doc-1", "text": "the document"}`` a line,
    each run with ``params``; ValueError naming a bad line."""
    docs = []
    for n, obj in read_lines(lines):
        _only(n, obj, ("custom_id", "text"))
        if not isinstance(obj.get("text"), str):
            raise ValueError(f'line {n}: needs a "text" string')
        docs.append(bpb.Document(custom_id=_custom_id(n, obj), text=obj["text"]))
    return bpb.Summarise(template=template, documents=docs, params=params)


def items(lines: Iterable[str]) -> list[bpb.BatchItem]:
    """The items of a file of ``{"custom_id": "q-1", "request": {...}}`` lines, ``request`` a
    GenerateRequest in protobuf JSON (``{"prompt": "...", "max_tokens": 64}`` or ``{"messages":
    [{"role": "user", "content": "..."}], "temperature": 0}``); ValueError naming a bad line."""
    out = []
    for n, obj in read_lines(lines):
        _only(n, obj, ("custom_id", "request"))
        if not isinstance(obj.get("request"), dict):
            raise ValueError(f'line {n}: needs a "request" object (a GenerateRequest in protobuf JSON)')
        request = pb.GenerateRequest()
        try:
            json_format.ParseDict(obj["request"], request)
        except (json_format.ParseError, RecursionError) as exc:  # (its first line: protobuf lists the fields after)
            raise ValueError(f"line {n}: bad request: {str(exc).splitlines()[0]}") from None
        out.append(bpb.BatchItem(custom_id=_custom_id(n, obj), request=request))
    return out


def result_line(r: bpb.BatchResult) -> str:
    """One line of ``batch results`` (BatchResult's fields): ``{"custom_id", "status" (succeeded |
    errored | cancelled | expired), "text", "finish_reason", "usage": {"prompt_tokens",
    "completion_tokens"}, "logprobs" (asked for), "samples" (n > 1), "error": {"code" (a gRPC status name), "reason",
    "message", "field" (a client error's)} (if any), "cursor"}``."""
    obj: dict[str, Any] = {
        "custom_id": r.custom_id,
        "status": bpb.BatchItemStatus.Name(r.status).removeprefix("BATCH_ITEM_STATUS_").lower(),
        "text": r.text,
    }
    if r.finish_reason:
        obj["finish_reason"] = _finish(r.finish_reason)
        obj["usage"] = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}
    if r.logprobs:
        obj["logprobs"] = _logprobs(r.logprobs)
    if r.samples:
        obj["samples"] = [{"text": x.text, "finish_reason": _finish(x.finish_reason)} for x in r.samples]
        for x, line in zip(r.samples, obj["samples"], strict=True):
            if x.logprobs:
                line["logprobs"] = _logprobs(x.logprobs)
    if r.error_code:
        obj["error"] = {"code": r.error_code, "reason": r.error_reason, "message": r.error_message}
        if r.error_field:
            obj["error"]["field"] = r.error_field
    obj["cursor"] = r.cursor
    return json.dumps(obj, ensure_ascii=False)


def _logprobs(items: Iterable[pb.TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token_id": x.token_id,
            "logprob": x.logprob,
            "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in x.top],
        }
        for x in items
    ]


def _finish(value: int) -> str:
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def batch_json(b: bpb.Batch) -> str:
    """A batch as indented JSON (protobuf JSON, the proto's field names)."""
    return json.dumps(json_format.MessageToDict(b, preserving_proto_field_name=True), indent=2)
