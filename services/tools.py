"""Tool calling at the gateway, the same whichever engine serves (a request that falls back to
another backend gets the same shape of answer):

- ``checked``: a request's tools, tool choice and chat turns with tool calls, validated, and the
  tools serialised for the worker, whose engine renders them with the model's chat template
  (workers/engines/prompts.py);
- ``constraint``: for ``required`` and a named function, the JSON Schema the output is generated
  under (every engine's constrained decoding), so that the answer always reads as a call;
- ``read_calls``: a finished output read as calls by the model family's form
  (``LLAMAMESH_GATEWAY_TOOL_PARSER``): ``llama3_json``, Llama 3.x's ``{"name": ..., "parameters":
  {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``, a JSON list of them, or several
  separated by ``;``; ``hermes``, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks as Hermes and Qwen models write them (or bare JSON calls, the form constrained decoding
  makes). Calls to unknown functions, or output that is not such, are not calls: that output is the
  answer's text, and its finish reason stays as it ended.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from llamamesh.errors import FieldViolation
from llamamesh.sampling import MAX_SCHEMA_DEPTH, json_depth
from llamamesh.schemas import dropped, unknown_type
from llamamesh.types import ConstraintKind, ResponseConstraint
from llamamesh.v1 import generation_pb2 as pb

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
PYTHON_TAG = "<|python_tag|>"
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPENERS = {"llama3_json": ("{", "[", PYTHON_TAG), "hermes": ("{", "[", "<tool_call>")}
MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tools:
    """A request's tools as checked: their names, the JSON the worker renders, the choice."""

    names: frozenset[str] = frozenset()
    json: str = ""  # for the worker's chat template ("" with none, or with choice "none")
    mode: str = "auto"  # "auto", "none", "required" or "function" (then ``function`` names it)
    function: str = ""
    parallel: bool = True
    schemas: tuple[tuple[str, dict[str, Any]], ...] = ()  # (name, parameters schema)
    parser: str = "llama3_json"  # the model family's form of calls (LLAMAMESH_GATEWAY_TOOL_PARSER)

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read as calls (tools given, and the choice is not "none")."""
        return bool(self.names) and self.mode != "none"


def checked(r: pb.GenerateRequest, bad: list[FieldViolation], parser: str = "llama3_json") -> Tools:
    """The request's tools and tool choice (violations go to ``bad``), read with ``parser``."""
    has_choice = r.HasField("tool_choice")
    if not r.tools:
        which = r.tool_choice.WhichOneof("choice") if has_choice else None
        if which == "function":
            bad.append(FieldViolation("tool_choice.function", "names a function, but there are no tools"))
        elif which == "mode" and r.tool_choice.mode not in MODES:
            bad.append(FieldViolation("tool_choice.mode", f"one of {', '.join(MODES)}"))
        elif which == "mode" and r.tool_choice.mode == "required":
            bad.append(FieldViolation("tool_choice.mode", "required needs tools to call"))
        return Tools()
    if r.HasField("prompt"):
        bad.append(FieldViolation("tools", "tools need messages (a chat), not a prompt"))
    if len(r.tools) > MAX_TOOLS:
        bad.append(FieldViolation("tools", f"{len(r.tools)} tools; at most {MAX_TOOLS}"))
    schemas: list[tuple[str, dict[str, Any]]] = []
    for i, t in enumerate(r.tools):
        if not TOOL_NAME.match(t.name):
            bad.append(FieldViolation(f"tools[{i}].name", "1-64 characters of A-Z a-z 0-9 _ -"))
        elif any(t.name == name for name, _ in schemas):
            bad.append(FieldViolation(f"tools[{i}].name", f"{t.name!r} is named twice"))
        schemas.append((t.name, _parameters(t.parameters, f"tools[{i}].parameters", bad)))
    mode, function = "auto", ""
    if has_choice:
        which = r.tool_choice.WhichOneof("choice")
        if which == "function":
            mode, function = "function", r.tool_choice.function
            if function not in {name for name, _ in schemas}:
                bad.append(FieldViolation("tool_choice.function", f"{function!r} is not one of the tools"))
        elif which == "mode":
            mode = r.tool_choice.mode
            if mode not in MODES:
                bad.append(FieldViolation("tool_choice.mode", f"one of {', '.join(MODES)}"))
    listed = [
        {"name": t.name, "description": t.description, "parameters": schema}
        for t, (_, schema) in zip(r.tools, schemas, strict=True)
    ]
    for i, (name, schema) in enumerate(schemas):  # (compiled into the grammar when a call is forced)
        forced = mode == "required" or (mode == "function" and name == function)
        if why := unknown_type(schema) or (forced and dropped(schema)):
            bad.append(FieldViolation(f"tools[{i}].parameters", why))
    parallel = r.parallel_tool_calls if r.HasField("parallel_tool_calls") else True
    return Tools(
        frozenset(name for name, _ in schemas),
        json.dumps(listed) if mode != "none" else "",
        mode,
        function,
        parallel,
        tuple(schemas),
        parser,
    )


def _parameters(text: str, field: str, bad: list[FieldViolation]) -> dict[str, Any]:
    if not text:
        return {"type": "object", "properties": {}}
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        bad.append(FieldViolation(field, f"not JSON: {exc}"))
        return {}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        bad.append(FieldViolation(field, "a JSON Schema of an object"))
        return {}
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        bad.append(FieldViolation(field, f"nests objects and lists at most {MAX_SCHEMA_DEPTH} deep"))
        return {}
    return schema


def message_calls(m: pb.ChatMessage, i: int, bad: list[FieldViolation]) -> str:
    """An assistant turn's tool calls as the worker's JSON ("" for none)."""
    if not m.tool_calls:
        return ""
    if m.role != "assistant":
        bad.append(FieldViolation(f"messages[{i}].tool_calls", "only an assistant turn makes tool calls"))
        return ""
    calls = []
    for k, c in enumerate(m.tool_calls):
        field = f"messages[{i}].tool_calls[{k}]"
        try:
            arguments = json.loads(c.arguments or "{}")
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            bad.append(FieldViolation(f"{field}.arguments", "a JSON object"))
        if not TOOL_NAME.match(c.name):
            bad.append(FieldViolation(f"{field}.name", "1-64 characters of A-Z a-z 0-9 _ -"))
        calls.append({"id": c.id, "name": c.name, "arguments": c.arguments or "{}"})
    return json.dumps(calls)


def constraint(tools: Tools) -> ResponseConstraint | None:
    """The schema that makes the output a call: to the named function, or (``required``) to one of
    the tools. None for "auto" and "none"."""
    if tools.mode not in ("required", "function"):
        return None
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in tools.schemas
        if tools.mode == "required" or name == tools.function
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return ResponseConstraint(ConstraintKind.JSON_SCHEMA, text=json.dumps(schema))


def read_calls(text: str, tools: Tools) -> list[pb.ToolCall] | None:
    """The calls ``text`` makes to ``tools`` (None: it is not calls, but the answer's text)."""
    body = text.strip()
    objs: list[Any] | None
    if tools.parser == "hermes" and body.startswith("<tool_call>"):
        blocks = HERMES_CALL.findall(body)
        if not blocks or HERMES_CALL.sub("", body).strip():  # only calls, each closed
            return None
        objs = [_json(b) for b in blocks]
    else:
        objs = _json_calls(body.removeprefix(PYTHON_TAG).strip())
    if objs is None or any(o is None for o in objs):
        return None
    calls = []
    for obj in objs:
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or name not in tools.names:
            return None
        arguments = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append(pb.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=json.dumps(arguments)))
    if not calls or (len(calls) > 1 and not tools.parallel):
        return None
    return calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_calls(body: str) -> list[Any] | None:
    """Llama 3.x's forms: one JSON object, a JSON list, or objects separated by ";"."""
    if not body.startswith(("{", "[")):
        return None
    parsed = _json(body)
    if parsed is not None:
        return parsed if isinstance(parsed, list) else [parsed]
    parts = [_json(part) for part in body.split(";") if part.strip()]
    return parts if parts and all(p is not None for p in parts) else None


def _may_be_calls(text: str, parser: str) -> bool:
    """Whether output that begins with ``text`` (stripped) can still turn out to be calls."""
    openers = OPENERS.get(parser, OPENERS["llama3_json"])
    return text.startswith(openers) or any(o.startswith(text) for o in openers)


class CallReader:
    """Reads one request's responses as calls where they are: a sample's messages are held back
    while its text may still be calls (it begins with JSON or the python tag); at the sample's end
    they become one message carrying the calls (their tokens, finish_reason TOOL_CALLS, no text), or
    go out as they were. Text that begins otherwise streams as it comes."""

    def __init__(self, tools: Tools) -> None:
        self._tools = tools
        self._held: dict[int, list[pb.GenerateResponse]] = {}
        self._plain: set[int] = set()

    def feed(self, r: pb.GenerateResponse) -> list[pb.GenerateResponse]:
        """What to send now for ``r`` (nothing while it is held)."""
        if not self._tools.reads_calls or r.sample in self._plain:
            return [r]
        held = self._held.setdefault(r.sample, [])
        held.append(r)
        text = "".join(m.text for m in held).lstrip()
        if text and not _may_be_calls(text, self._tools.parser):
            self._plain.add(r.sample)
            return self._held.pop(r.sample)
        if not r.finish_reason:
            return []
        del self._held[r.sample]
        calls = read_calls(text, self._tools)
        if calls is None:
            return held
        merged = pb.GenerateResponse()
        merged.CopyFrom(r)  # the last message: its finish, usage, timings
        merged.text = ""
        merged.index = held[0].index
        merged.ClearField("token_ids")
        merged.token_ids.extend(t for m in held for t in m.token_ids)
        merged.ClearField("logprobs")
        merged.logprobs.extend(lp for m in held for lp in m.logprobs)
        merged.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        merged.tool_calls.extend(calls)
        return [merged]
