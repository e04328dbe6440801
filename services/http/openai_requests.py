"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) as the gateway's own
``GenerateRequest``: the HTTP door checks only the JSON's shape here, then the request goes through
the same conversion, validation and policy as a gRPC Generate (services/convert.py). The field a
violation names is translated back to the caller's own (``caller_field``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from llamamesh.errors import FieldViolation, InvalidRequest
from llamamesh.sampling import MAX_LOGPROBS
from llamamesh.v1 import generation_pb2 as pb

# OpenAI's roles as the gateway's chat roles ("developer" is OpenAI's newer name for "system").
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# vLLM's extra sampling fields, accepted as vLLM's OpenAI server accepts them.
EXTRA_FLOATS = ("min_p", "repetition_penalty")
EXTRA_INTS = ("top_k", "min_tokens")
# Fields OpenAI defines that this door does not implement: refused by name rather than ignored.
UNSUPPORTED = ("functions", "function_call", "audio", "modalities", "prediction", "logit_bias")
UNSUPPORTED_COMPLETIONS = {"suffix": "", "echo": False, "best_of": 1}  # each accepted only at this value
# A tool's and a tool call's own fields, which OpenAI's requests hold under ``function``.
FUNCTION_FIELD = re.compile(
    r"^(tools\[\d+\]|messages\[\d+\]\.tool_calls\[\d+\])\.(name|description|parameters|arguments)\b"
)
MAX_PROMPTS = 64  # prompts in one completions request (each is a generation of its own)


@dataclass(frozen=True)
class Parsed:
    """One request of either endpoint, as the gateway's request plus what only the door uses."""

    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: bool  # chat: logprobs requested (top_logprobs says how many alternatives)
    renamed: dict[str, str]  # the gateway's field -> the caller's
    prompts: tuple[str, ...] = ()  # completions given a list of prompts: every one (request has the first)

    def requests(self, base_id: str) -> list[pb.GenerateRequest]:
        """The gateway's requests: ``request``, or one per prompt of a list, with ids
        ``<base_id>:<i>``."""
        if len(self.prompts) <= 1:
            return [self.request]
        out = []
        for i, prompt in enumerate(self.prompts):
            r = pb.GenerateRequest()
            r.CopyFrom(self.request)
            r.prompt, r.request_id = prompt, f"{base_id}:{i}"
            out.append(r)
        return out

    def caller_field(self, field: str) -> str:
        if field in self.renamed:  # a whole path renamed (tool_choice.mode: OpenAI's tool_choice itself)
            return self.renamed[field]
        head, dot, rest = field.partition(".")
        if head == "metadata[user]":  # the request's label from OpenAI's ``user``
            return "user" + dot + rest
        name, bracket, index = head.partition("[")
        mapped = self.renamed.get(name, name) + bracket + index + dot + rest
        # A tool's and a tool call's own fields are under OpenAI's ``function``.
        return FUNCTION_FIELD.sub(r"\1.function.\2", mapped)


class _Body:
    """Typed reads of a JSON object's fields, collecting every violation before raising."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise InvalidRequest.field("body", "must be a JSON object")
        self.body: dict[str, Any] = body
        self.bad: list[FieldViolation] = []

    def get(self, name: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.body.get(name)
        if value is None:
            return None
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _kinds(kind))
        if not ok:
            self.bad.append(FieldViolation(name, f"must be {what}"))
            return None
        return value

    def check(self) -> None:
        if self.bad:
            raise InvalidRequest(self.bad)


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


# The gateway's fields a chat request names otherwise (the prompt is its messages; a whole path, or a
# path's head).
CHAT_FIELDS = {
    "prompt": "messages",
    "request_id": "x-request-id",
    "tool_choice.mode": "tool_choice",
    "tool_choice.function": "tool_choice.function.name",
}


def chat(body: object, request_id: str) -> Parsed:
    b = _Body(body)
    req = pb.GenerateRequest(request_id=request_id)
    renamed = dict(CHAT_FIELDS)
    if b.body.get("messages") is None:
        b.bad.append(FieldViolation("messages", "required: a list of messages"))
    messages = b.get("messages", list, "a list of messages")
    if messages == []:
        b.bad.append(FieldViolation("messages", "needs at least one message"))
    for i, m in enumerate(messages or []):
        _message(m, i, req, b)
    logprobs = b.get("logprobs", bool, "true or false") or False
    if b.body.get("top_logprobs") is not None and not logprobs:
        b.bad.append(FieldViolation("top_logprobs", "needs logprobs: true"))
    elif logprobs:
        req.logprobs = 0
        _set(b, req, "top_logprobs", int, "an integer from 0 to 20", "logprobs")
    top = b.body.get("top_logprobs")
    renamed["logprobs"] = "top_logprobs" if top is not None else "logprobs"
    limit = "max_completion_tokens" if b.body.get("max_completion_tokens") is not None else "max_tokens"
    renamed["max_tokens"] = limit
    _common(b, req, limit)
    _tools(b, req)
    return _parsed(b, req, chat=True, logprobs=logprobs, renamed=renamed)


def completion(body: object, request_id: str) -> Parsed:
    b = _Body(body)
    req = pb.GenerateRequest(request_id=request_id)
    prompts = _prompts(b)
    if prompts:
        req.prompt = prompts[0]
    for name, default in UNSUPPORTED_COMPLETIONS.items():
        value = b.body.get(name)
        if value is not None and (type(value) is not type(default) or value != default):  # (True == 1)
            b.bad.append(FieldViolation(name, "not supported by this server"))
    _set(b, req, "logprobs", int, f"an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    logprobs = req.HasField("logprobs")
    _common(b, req, "max_tokens")
    parsed = _parsed(b, req, chat=False, logprobs=logprobs, renamed={"request_id": "x-request-id"})
    return replace(parsed, prompts=prompts) if len(prompts) > 1 else parsed


def _prompts(b: _Body) -> tuple[str, ...]:
    """``prompt``: a string, or a list of (at most MAX_PROMPTS) strings; () when it is neither."""
    prompt = b.body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
        if len(prompts) <= MAX_PROMPTS:
            return tuple(prompts)
        b.bad.append(FieldViolation("prompt", f"at most {MAX_PROMPTS} prompts in one request"))
    elif isinstance(prompts, list) and prompts and all(isinstance(p, int | list) for p in prompts):
        b.bad.append(FieldViolation("prompt", "token ids are not supported: send the text"))
    elif isinstance(prompts, list) and prompts:  # a list of strings but for one
        i = next(i for i, p in enumerate(prompts) if not isinstance(p, str))
        b.bad.append(FieldViolation(f"prompt[{i}]", "must be a string"))
    else:
        b.bad.append(FieldViolation("prompt", "required: a string or a non-empty list of strings"))
    return ()


def _parsed(b: _Body, req: pb.GenerateRequest, chat: bool, logprobs: bool, renamed: dict[str, str]) -> Parsed:
    stream = b.get("stream", bool, "true or false") or False
    options = b.get("stream_options", dict, "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        b.bad.append(FieldViolation("stream_options.include_usage", "must be true or false"))
    if options and not stream:
        b.bad.append(FieldViolation("stream_options", "only with stream: true"))
    b.check()
    return Parsed(req, stream, bool(include_usage), chat, logprobs, renamed)


def _message(m: object, i: int, req: pb.GenerateRequest, b: _Body) -> None:
    field = f"messages[{i}]"
    if not isinstance(m, dict):
        b.bad.append(FieldViolation(field, "must be an object with role and content"))
        return
    role = m.get("role")
    if role not in ROLES:
        b.bad.append(FieldViolation(f"{field}.role", f"must be one of {sorted(ROLES)}"))
        return
    content = m.get("content")
    if content is None and m.get("tool_calls"):  # an assistant turn of calls only
        content = ""
    if isinstance(content, list):  # content parts: the text ones, a line each (as vLLM's server joins them)
        texts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        wrong = next((k for k, t in enumerate(texts) if not isinstance(t, str)), None)
        if wrong is not None:
            part = content[wrong]
            why = "text must be a string" if isinstance(part, dict) and part.get("type") == "text" else ""
            b.bad.append(FieldViolation(f"{field}.content[{wrong}]", why or "only text parts are supported"))
            return
        content = "\n".join(t for t in texts if isinstance(t, str))
    if not isinstance(content, str):
        b.bad.append(FieldViolation(f"{field}.content", "must be a string or a list of text parts"))
        return
    turn = req.messages.add(role=ROLES[role], content=content, tool_call_id=str(m.get("tool_call_id") or ""))
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        b.bad.append(FieldViolation(f"{field}.tool_calls", "must be a list of calls"))
        return
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            b.bad.append(
                FieldViolation(f"{field}.tool_calls[{k}]", "must be {id, type: function, function: {name, arguments}}")
            )
            continue
        arguments = fn.get("arguments", "{}")
        turn.tool_calls.add(
            id=str(c.get("id", "")),
            name=fn["name"],
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )


def _common(b: _Body, req: pb.GenerateRequest, limit: str) -> None:
    """The fields both endpoints share, onto ``req``; ``limit``: the caller's name of max_tokens."""
    for name in UNSUPPORTED:
        if b.body.get(name) not in (None, {}, []):  # (empty: the same as not sent)
            b.bad.append(FieldViolation(name, "not supported by this server"))
    _set(b, req, "model", str, "a string", "model")
    _set(b, req, limit, int, "an integer", "max_tokens")
    number = (int, float)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", *EXTRA_FLOATS):
        _set(b, req, name, number, "a number", name)
    for name in ("seed", "n", *EXTRA_INTS):
        _set(b, req, name, int, "an integer", name)
    _set(b, req, "ignore_eos", bool, "true or false", "ignore_eos")
    stop = b.body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)
    elif stop is not None:
        b.bad.append(FieldViolation("stop", "must be a string or a list of strings"))
    ids = b.get("stop_token_ids", list, "a list of integers") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        b.bad.append(FieldViolation("stop_token_ids", "must be a list of integers"))
    else:
        try:
            req.stop_token_ids.extend(ids)
        except (ValueError, TypeError):  # out of the protobuf field's range
            b.bad.append(FieldViolation("stop_token_ids", "token ids out of range"))
    _response_format(b, req)
    _labels(b, req)


def _tools(b: _Body, req: pb.GenerateRequest) -> None:
    """``tools`` (functions), ``tool_choice`` and ``parallel_tool_calls`` onto ``req``."""
    for i, t in enumerate(b.get("tools", list, "a list of tools") or []):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            b.bad.append(FieldViolation(f"tools[{i}]", 'must be {"type": "function", "function": {name, ...}}'))
            continue
        params = fn.get("parameters")
        req.tools.add(
            name=fn["name"],
            description=str(fn.get("description") or ""),
            parameters=json.dumps(params) if params is not None else "",
        )
    choice = b.body.get("tool_choice")
    if isinstance(choice, str):
        req.tool_choice.mode = choice
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        req.tool_choice.function = choice["function"]["name"]
    elif choice is not None:
        b.bad.append(
            FieldViolation("tool_choice", 'none, auto, required, or {"type": "function", "function": {"name"}}')
        )
    _set(b, req, "parallel_tool_calls", bool, "true or false", "parallel_tool_calls")


def _set(b: _Body, req: pb.GenerateRequest, name: str, kind: Any, what: str, target: str) -> None:
    value = b.get(name, kind, what)
    if value is None:
        return
    try:
        setattr(req, target, value)
    except (ValueError, TypeError):  # out of the protobuf field's range (int32, uint32)
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} characters)"
        b.bad.append(FieldViolation(name, f"{shown} is out of range"))


def _response_format(b: _Body, req: pb.GenerateRequest) -> None:
    fmt = b.get("response_format", dict, "an object")
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        req.response_format.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            b.bad.append(FieldViolation("response_format.json_schema.schema", "required: a JSON Schema object"))
            return
        req.response_format.json_schema = json.dumps(schema)
    else:
        b.bad.append(FieldViolation("response_format.type", "must be text, json_object or json_schema"))


def _labels(b: _Body, req: pb.GenerateRequest) -> None:
    """``metadata`` (string values) and ``user`` become the request's logged labels."""
    meta = b.get("metadata", dict, "an object of strings") or {}
    if not all(isinstance(v, str) for v in meta.values()):
        b.bad.append(FieldViolation("metadata", "values must be strings"))
        return
    req.metadata.update(meta)
    user = b.get("user", str, "a string")
    if user:
        req.metadata["user"] = user


Parse = Callable[[object, str], Parsed]
