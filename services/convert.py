"""Public protobuf <-> domain types, and the validation of what a caller sends.

Pure functions: no I/O, no grpc. Every rejected field is named in an
``InvalidRequest`` (all violations at once, not just the first).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from types import MappingProxyType

from google.protobuf.duration_pb2 import Duration

from llamamesh import sampling
from llamamesh.errors import FieldViolation, InvalidRequest, ModelNotFound
from llamamesh.queue import codec
from llamamesh.settings import GatewaySettings
from llamamesh.types import (
    ADAPTER_NAME,
    CHAT_ROLES,
    MAX_PREFIX_KEY_CHARS,
    ChatMessage,
    FinishReason,
    GenerationRequest,
    JobEvent,
    JobKind,
    ModelInfo,
    SamplingParams,
    affinity_key,
)
from llamamesh.v1 import generation_pb2 as pb
from services import tools

MAX_REQUEST_ID = 128
REQUEST_ID = re.compile(rf"^[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID}}}$")
ID_RULE = f"1-{MAX_REQUEST_ID} characters of A-Z a-z 0-9 . _ : -"  # what REQUEST_ID takes, as errors say it
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_METADATA = 64
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def shown(name: str, most: int = 64) -> str:
    """A caller's name quoted for an error message, cut at ``most`` characters: the message goes back
    in a gRPC header, which clients cap at 8 KiB."""
    return repr(name if len(name) <= most else name[:most] + "...")


def resolve_model(name: str, models: Sequence[ModelInfo]) -> ModelInfo:
    """The model a request names (empty: the default). Unknown -> ModelNotFound."""
    if not name:
        return next(m for m in models if m.default)
    for m in models:
        if m.id == name:
            return m
    raise ModelNotFound(f"model {shown(name)} is not served here; ListModels lists the models")


def resolve_adapter(name: str, adapter: str, models: Sequence[ModelInfo]) -> tuple[ModelInfo, str]:
    """The base model and the LoRA adapter a request names: ``adapter`` with ``name``, or ``name`` as
    "<model>:<adapter>" when no model is called that. InvalidRequest for a malformed adapter name,
    ModelNotFound for an unknown model."""
    if not adapter and name and ":" in name and all(m.id != name for m in models):
        name, _, adapter = name.rpartition(":")
    if adapter and not ADAPTER_NAME.match(adapter):
        raise InvalidRequest.field("adapter", "1-64 characters of A-Z a-z 0-9 . _ -")
    return resolve_model(name, models), adapter


def _input(
    prompt: str | None, messages: Sequence[pb.ChatMessage], bad: list[FieldViolation], max_chars: int
) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """The prompt or the chat turns, bounded in characters (before anything tokenises them)."""
    chars = len(prompt) if prompt is not None else sum(len(m.content) for m in messages)
    if max_chars and chars > max_chars:
        field = "prompt" if prompt is not None else "messages"
        most = f"at most {max_chars} (LLAMAMESH_GATEWAY_MAX_PROMPT_CHARS)"
        bad.append(FieldViolation(field, f"{chars} characters; {most}"))
        return None, None
    if prompt is not None and messages:
        bad.append(FieldViolation("prompt", "set exactly one of prompt or messages, not both"))
        return None, None
    if prompt is None and not messages:
        bad.append(FieldViolation("prompt", "set exactly one of prompt or messages"))
        return None, None
    if prompt is not None:
        if not prompt:
            bad.append(FieldViolation("prompt", "must not be empty"))
        return prompt, None
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            bad.append(
                FieldViolation(f"messages[{i}].role", f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}")
            )
        if m.tool_call_id and m.role != "tool":
            bad.append(FieldViolation(f"messages[{i}].tool_call_id", "only a tool turn answers a call"))
        elif m.role == "tool" and not m.tool_call_id:
            bad.append(FieldViolation(f"messages[{i}].tool_call_id", "required: the id of the call it answers"))
    turns = tuple(
        ChatMessage(m.role, m.content, tools.message_calls(m, i, bad), m.tool_call_id) for i, m in enumerate(messages)
    )
    return None, turns


def _sampling(r: pb.GenerateRequest, s: GatewaySettings, bad: list[FieldViolation]) -> SamplingParams:
    """The sampling fields as the domain type, checked by the shared rules (llamamesh/sampling.py)
    plus the gateway's own bounds (max_tokens cap, stop strings), then normalised (a temperature
    below 1e-5 is greedy)."""

    def opt(name: str) -> object | None:
        return getattr(r, name) if r.HasField(name) else None

    max_tokens = r.max_tokens if r.HasField("max_tokens") else min(s.default_max_tokens, s.max_tokens_cap)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=opt("temperature"),  # type: ignore[arg-type]
        top_p=opt("top_p"),  # type: ignore[arg-type]
        top_k=opt("top_k"),  # type: ignore[arg-type]
        min_p=opt("min_p"),  # type: ignore[arg-type]
        presence_penalty=opt("presence_penalty"),  # type: ignore[arg-type]
        frequency_penalty=opt("frequency_penalty"),  # type: ignore[arg-type]
        repetition_penalty=opt("repetition_penalty"),  # type: ignore[arg-type]
        stop=tuple(r.stop),
        stop_token_ids=tuple(r.stop_token_ids),
        seed=opt("seed"),  # type: ignore[arg-type]
        ignore_eos=opt("ignore_eos"),  # type: ignore[arg-type]
        min_tokens=opt("min_tokens"),  # type: ignore[arg-type]
        logprobs=opt("logprobs"),  # type: ignore[arg-type]
        constraint=codec.constraint_from_pb(r.response_format, "format") if r.HasField("response_format") else None,
        n=opt("n"),  # type: ignore[arg-type]
    )
    found = sampling.violations(params, s.max_tokens_cap)
    if len(r.stop) > MAX_STOP_STRINGS:
        found.append(FieldViolation("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(r.stop)}"))
    found += [
        FieldViolation(f"stop[{i}]", f"at most {MAX_STOP_LENGTH} characters")
        for i, x in enumerate(r.stop)
        if len(x) > MAX_STOP_LENGTH
    ]
    if r.response_format.WhichOneof("format") == "json_object" and not r.response_format.json_object:
        found.append(FieldViolation("response_format.json_object", "must be true (no response_format: text)"))
    bad.extend(found)
    return params if found else sampling.normalized(params)


def _request_id(given: str, bad: list[FieldViolation]) -> str:
    if not given:
        return uuid.uuid4().hex
    if not REQUEST_ID.match(given):
        bad.append(FieldViolation("request_id", ID_RULE))
    return given


def metadata(items: Iterable[tuple[str, str]], bad: list[FieldViolation]) -> MappingProxyType[str, str]:
    """A request's or a batch's labels, bounded (they are logged and stored with it): ``MAX_METADATA`` entries, keys of
    1-``MAX_METADATA_KEY`` characters, values of at most ``MAX_METADATA_VALUE``."""
    meta = dict(items)
    if len(meta) > MAX_METADATA:
        bad.append(FieldViolation("metadata", f"{len(meta)} entries; at most {MAX_METADATA}"))
        return MappingProxyType({})
    for key, value in meta.items():
        if not 0 < len(key) <= MAX_METADATA_KEY:
            bad.append(FieldViolation("metadata", f"a key of {len(key)} characters; 1 to {MAX_METADATA_KEY}"))
        elif len(value) > MAX_METADATA_VALUE:
            bad.append(FieldViolation(f"metadata[{key}]", f"{len(value)} characters; at most {MAX_METADATA_VALUE}"))
    return MappingProxyType(meta)


def generate_request(
    r: pb.GenerateRequest, s: GatewaySettings, models: Sequence[ModelInfo], tools_allowed: bool = True
) -> tuple[GenerationRequest, ModelInfo]:
    """Validate a GenerateRequest. Raises InvalidRequest (every bad field) or NotFound (model).
    ``tools_allowed`` False (a batch's items): tools are refused."""
    bad: list[FieldViolation] = []
    rid = _request_id(r.request_id, bad)
    prompt, messages = _input(r.prompt if r.HasField("prompt") else None, r.messages, bad, s.max_prompt_chars)
    sampling = _sampling(r, s, bad)
    offered = tools.checked(r, bad, s.tool_parser)
    if r.tools and not tools_allowed:
        bad.append(FieldViolation("tools", "tool calling is not offered in batches"))
    forced = tools.constraint(offered)
    if forced is not None:
        if r.HasField("response_format"):
            bad.append(FieldViolation("tool_choice", "a required or named tool call cannot have a response_format too"))
        sampling = replace(sampling, constraint=forced)
    meta = metadata(r.metadata.items(), bad)
    key = _prefix_key(r, prompt, messages, s, bad)
    if bad:
        raise InvalidRequest(bad)
    model, adapter = resolve_adapter(r.model, r.adapter, models)
    req = GenerationRequest(
        request_id=rid,
        model=model.id,
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        priority=r.priority,
        metadata=meta,
        accepted_unix_ns=time.time_ns(),
        prefix_key=key,
        adapter=adapter,
        tools=offered.json,
    )
    return req, model


def _prefix_key(
    r: pb.GenerateRequest,
    prompt: str | None,
    messages: tuple[ChatMessage, ...] | None,
    s: GatewaySettings,
    bad: list[FieldViolation],
) -> str:
    """The caller's prefix_key (bounded), else a hash of the input's start (prefix affinity)."""
    if r.HasField("prefix_key"):
        if len(r.prefix_key) > MAX_PREFIX_KEY_CHARS:
            bad.append(FieldViolation("prefix_key", f"at most {MAX_PREFIX_KEY_CHARS} characters"))
        return r.prefix_key
    return affinity_key(prompt, messages, s.affinity_prefix_chars)


def tokenize_request(
    r: pb.TokenizeRequest, models: Sequence[ModelInfo], max_chars: int = 0
) -> tuple[GenerationRequest, ModelInfo]:
    """Validate a TokenizeRequest. Raises InvalidRequest or NotFound."""
    bad: list[FieldViolation] = []
    prompt, messages = _input(r.prompt if r.HasField("prompt") else None, r.messages, bad, max_chars)
    if bad:
        raise InvalidRequest(bad)
    model = resolve_model(r.model, models)
    req = GenerationRequest(
        request_id=f"t~{uuid.uuid4().hex}",  # "~": in no caller's id
        model=model.id,
        prompt=prompt,
        messages=messages,
        kind=JobKind.TOKENIZE,
        accepted_unix_ns=time.time_ns(),
    )
    return req, model


def _duration(ns: int) -> Duration:
    d = Duration()
    d.FromNanoseconds(max(ns, 0))
    return d


def generate_response(
    req: GenerationRequest, ev: JobEvent, now_ns: int | None = None, request_id: str | None = None
) -> pb.GenerateResponse:
    """One response message from one event; the terminal one carries finish, usage, timings.
    ``request_id``: the id the caller knows (default ``req.request_id``)."""
    msg = pb.GenerateResponse(
        request_id=req.request_id if request_id is None else request_id,
        text=ev.text,
        token_ids=ev.token_ids,
        index=ev.index,
        logprobs=codec.logprobs_to_pb(ev.logprobs, pb.TokenLogprob, pb.TopLogprob),
        model=req.model,
        sample=ev.sample,
    )
    if ev.sample_end is not None:
        msg.finish_reason = FINISH_TO_PB[ev.sample_end]
    f = ev.finished
    if f is not None:
        now = time.time_ns() if now_ns is None else now_ns
        msg.finish_reason = FINISH_TO_PB[f.finish_reason]
        u = f.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens
            )
        )
        t0 = req.accepted_unix_ns
        msg.timings.CopyFrom(
            pb.Timings(
                queue_wait=_duration(f.started_unix_ns - t0) if f.started_unix_ns else None,
                time_to_first_token=_duration(f.first_token_unix_ns - t0) if f.first_token_unix_ns else None,
                total=_duration(now - t0),
            )
        )
    return msg


def cancelled_response(req: GenerationRequest) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=req.request_id, model=req.model, finish_reason=pb.FINISH_REASON_CANCELLED)


def model_list(models: Sequence[ModelInfo]) -> pb.ListModelsResponse:
    return pb.ListModelsResponse(
        models=[pb.Model(id=m.id, pool=m.pool, default=m.default, base=m.base, adapter=m.adapter) for m in models]
    )


def check_adapter(adapter: str, model: ModelInfo, adapters_of: Callable[[str], frozenset[str] | None]) -> None:
    """ModelNotFound for an adapter no ready worker of the model's pool serves (``adapters_of(pool)``; while
    none is ready, None: the request waits like any other, and its worker refuses an adapter it lacks)."""
    served = adapters_of(model.pool)
    if adapter and served is not None and adapter not in served:
        raise ModelNotFound(
            f"adapter {shown(adapter)} of model {model.id!r} is not served (ListModels lists the adapters; "
            "AdminService LoadAdapter loads one)"
        )


def with_adapters(models: Sequence[ModelInfo], adapters_of: Callable[[str], frozenset[str] | None]) -> list[ModelInfo]:
    """``models`` and, after each, the LoRA adapters its pool's workers serve ("<model>:<adapter>")."""
    out: list[ModelInfo] = []
    for m in models:
        out.append(m)
        out += [ModelInfo(f"{m.id}:{a}", m.pool, adapter=a, base=m.id) for a in sorted(adapters_of(m.pool) or ())]
    return out


def tokenize_response(req: GenerationRequest, ev: JobEvent) -> pb.TokenizeResponse:
    return pb.TokenizeResponse(token_ids=ev.token_ids, count=len(ev.token_ids), model=req.model)
