"""The gateway's ``GenerateResponse`` stream as OpenAI's objects: ``chat.completion`` and
``text_completion`` (whole), their streamed chunks, and errors in OpenAI's shape with the HTTP
status a client expects for each gRPC code (the one table of services/status.py decides the code).

Tokens are named as vLLM's ``return_tokens_as_token_ids`` names them ("token_id:<id>"): the gateway
holds no tokenizer, the engine does."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from llamamesh import errors
from llamamesh.v1 import generation_pb2 as pb
from services import status

FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
# gRPC code -> (HTTP status, OpenAI error type)
HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def error(exc: BaseException, rename: Any = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, body, headers) for ``exc``: a domain error's own message (the first bad field
    named as the caller named it, through ``rename``), else a fixed one (services/status.py logs it)."""
    st = status.to_status(exc)  # logs what is not a domain error
    code = status.code_for(exc)
    http, kind = HTTP.get(code, (500, "internal_error"))
    param = None
    if isinstance(exc, errors.InvalidRequest) and exc.violations:
        first = exc.violations[0]
        param = rename(first.field) if rename else first.field
        message = "; ".join(f"{rename(v.field) if rename else v.field}: {v.description}" for v in exc.violations)
    else:
        message = st.message
    headers = {}
    if isinstance(exc, errors.CapacityError | errors.QueueUnavailable):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    code_name = exc.code if isinstance(exc, errors.LlamameshError) else "internal_error"
    return http, {"error": {"message": message, "type": kind, "param": param, "code": code_name}}, headers


def _logprobs(entries: list[pb.TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": token_name(e.token_id),
            "logprob": e.logprob,
            "bytes": None,
            "top_logprobs": [{"token": token_name(t.token_id), "logprob": t.logprob, "bytes": None} for t in e.top],
        }
        for e in entries
    ]


def usage(u: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    calls: list[pb.ToolCall] = field(default_factory=list)


def tool_calls(calls: list[pb.ToolCall], deltas: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` (with ``deltas``: a streamed delta's, each with its index)."""
    out = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return [{"index": i, **c} for i, c in enumerate(out)] if deltas else out


@dataclass
class Completion:
    """One request's answer, built from its responses: whole (``add`` each, then ``body``) or as
    chunks (``chunk`` for each response)."""

    request_id: str
    chat: bool
    logprobs: bool
    per_prompt: int = 1  # choices of each prompt (n): prompt p's sample s is choice p * n + s
    # stream_options.include_usage: every chunk has "usage" (null but the last, OpenAI's form)
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    model: str = ""
    choices: dict[int, Choice] = field(default_factory=dict)
    usages: dict[int, pb.Usage] = field(default_factory=dict)  # each prompt's, once it has ended
    _started: set[int] = field(default_factory=set)

    @property
    def usage(self) -> dict[str, Any] | None:
        """Every prompt's usage together (None before any has ended)."""
        if not self.usages:
            return None
        total = pb.Usage()
        for u in self.usages.values():
            total.prompt_tokens += u.prompt_tokens
            total.completion_tokens += u.completion_tokens
            total.cached_tokens += u.cached_tokens
        return usage(total)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request_id}"

    def add(self, r: pb.GenerateResponse, prompt: int = 0) -> int:
        """Take ``r``, a response to prompt ``prompt``; returns its choice's index."""
        self.model = r.model or self.model
        index = prompt * self.per_prompt + r.sample
        c = self.choices.setdefault(index, Choice())
        c.text.append(r.text)
        c.logprobs.extend(r.logprobs)
        c.calls.extend(r.tool_calls)
        if r.finish_reason:
            c.finish = FINISH.get(r.finish_reason, "stop")
        if r.HasField("usage"):
            self.usages[prompt] = r.usage
        return index

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def body(self) -> dict[str, Any]:
        """The whole answer, usage included."""
        choices = [self._whole(i, c) for i, c in sorted(self.choices.items())]
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, choices), "usage": self.usage or usage(pb.Usage())}

    def _whole(self, i: int, c: Choice) -> dict[str, Any]:
        text = "".join(c.text)
        if self.chat:
            lp = {"content": _logprobs(c.logprobs)} if self.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if c.calls:
                message = {"role": "assistant", "content": None, "tool_calls": tool_calls(c.calls)}
            return {"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish}
        return {"index": i, "text": text, "logprobs": self._completion_logprobs(c.logprobs), "finish_reason": c.finish}

    def _completion_logprobs(self, entries: list[pb.TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {
            "tokens": [token_name(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_name(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": [],
        }

    def chunks(self, r: pb.GenerateResponse, prompt: int = 0) -> list[dict[str, Any]]:
        """The streamed chunks of one response: its chunk, and for tool calls that end the choice, their
        finish reason in a chunk of its own after them, as OpenAI sends it (the SDKs' stream helpers
        say a call is done on that chunk)."""
        one = self.chunk(r, prompt)
        if not (self.chat and r.tool_calls and r.finish_reason):
            return [one]
        (choice,) = one["choices"]
        ends = {**one, "choices": [{**choice, "delta": {}, "logprobs": None}]}
        return [{**one, "choices": [{**choice, "finish_reason": None}]}, ends]

    def chunk(self, r: pb.GenerateResponse, prompt: int = 0) -> dict[str, Any]:
        """The streamed chunk of one response (the first of each choice carries the role)."""
        index = self.add(r, prompt)
        finish = FINISH.get(r.finish_reason) if r.finish_reason else None
        if self.chat:
            delta: dict[str, Any] = {"content": r.text}
            if r.tool_calls:
                delta = {"content": None, "tool_calls": tool_calls(list(r.tool_calls), deltas=True)}
            if index not in self._started:
                self._started.add(index)
                delta = {"role": "assistant", **delta}
            lp = {"content": _logprobs(list(r.logprobs))} if self.logprobs else None
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            lp2 = self._completion_logprobs(list(r.logprobs))
            choice = {"index": index, "text": r.text, "logprobs": lp2, "finish_reason": finish}
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        return {**chunk, "usage": None} if self.include_usage else chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": self.usage or usage(pb.Usage())}
