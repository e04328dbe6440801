"""Domain types <-> the internal protobuf messages that travel through Redis."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from llamamesh.errors import InvalidRequest
from llamamesh.internal.v1 import job_pb2 as pb
from llamamesh.types import (
    ChatMessage,
    ConstraintKind,
    Failure,
    Finished,
    FinishReason,
    GenerationRequest,
    ItemResult,
    ItemStatus,
    JobEvent,
    JobKind,
    ResponseConstraint,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerStatus,
)

_M = TypeVar("_M")
_KIND_TO_PB = {JobKind.GENERATE: pb.JOB_KIND_GENERATE, JobKind.TOKENIZE: pb.JOB_KIND_TOKENIZE}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_REPEATED = {"stop", "stop_token_ids"}


def constraint_from_pb(msg: Any, oneof: str) -> ResponseConstraint | None:
    """The constraint set in ``msg``'s oneof ``oneof`` (the public ResponseFormat's ``format`` or the
    job's ``constraint``: the same field names), or None."""
    which = msg.WhichOneof(oneof)
    if which is None:
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return ResponseConstraint(kind, options=tuple(msg.choice.options))
    if kind is ConstraintKind.JSON_OBJECT:
        return ResponseConstraint(kind)
    return ResponseConstraint(kind, text=getattr(msg, which))


def constraint_to_pb(c: ResponseConstraint, msg: Any) -> None:
    """Set ``c`` in ``msg`` (a ResponseFormat or a job's Sampling)."""
    if c.kind is ConstraintKind.CHOICE:
        msg.choice.options.extend(c.options)
    elif c.kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    else:
        setattr(msg, c.kind.value, c.text)


def encode_job(req: GenerationRequest) -> bytes:
    job = pb.Job(
        kind=_KIND_TO_PB[req.kind],
        request_id=req.request_id,
        model=req.model,
        priority=req.priority,
        metadata=dict(req.metadata),
        accepted_unix_ns=req.accepted_unix_ns,
        resume_token_ids=req.resume_token_ids,
        batch_id=req.batch_id,
        custom_id=req.custom_id,
        deadline_unix_ns=req.deadline_unix_ns,
        origin_id=req.origin_id,
        tenant=req.tenant,
        trace=dict(req.trace),
        prefix_key=req.prefix_key,
        resume_samples=[pb.SampleTokens(sample=k, token_ids=ids) for k, ids in sorted(req.resume_samples.items())],
        adapter=req.adapter,
        tools=req.tools,
        cache_salt=req.cache_salt,
    )
    if req.prompt is not None:
        job.prompt = req.prompt
    elif req.messages is not None:
        job.messages.messages.extend(
            pb.Message(role=m.role, content=m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id)
            for m in req.messages
        )
    for f in dataclasses.fields(SamplingParams):
        value = getattr(req.sampling, f.name)
        if f.name == "constraint":
            if value is not None:
                constraint_to_pb(value, job.sampling)
        elif f.name in _REPEATED:
            getattr(job.sampling, f.name).extend(value)
        elif value is not None:
            setattr(job.sampling, f.name, value)
    return job.SerializeToString()


def decode_job(data: bytes) -> GenerationRequest:
    """Decode a work-stream entry; an undecodable one raises InvalidRequest."""
    job = pb.Job()
    try:
        job.ParseFromString(data)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise InvalidRequest.field("job", "undecodable job entry") from exc
    values: dict[str, object] = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name == "constraint":
            values[f.name] = constraint_from_pb(job.sampling, "constraint")
        elif f.name in _REPEATED:
            values[f.name] = tuple(getattr(job.sampling, f.name))
        elif job.sampling.HasField(f.name):
            values[f.name] = getattr(job.sampling, f.name)
    which = job.WhichOneof("input")
    return GenerationRequest(
        request_id=job.request_id,
        model=job.model,
        prompt=job.prompt if which == "prompt" else None,
        messages=(
            tuple(ChatMessage(m.role, m.content, m.tool_calls, m.tool_call_id) for m in job.messages.messages)
            if which == "messages"
            else None
        ),
        sampling=SamplingParams(**values),  # type: ignore[arg-type]  # fields come from the dataclass itself
        priority=job.priority,
        metadata=MappingProxyType(dict(job.metadata)),
        kind=_KIND_FROM_PB.get(job.kind, JobKind.GENERATE),
        accepted_unix_ns=job.accepted_unix_ns,
        resume_token_ids=tuple(job.resume_token_ids),
        batch_id=job.batch_id,
        custom_id=job.custom_id,
        deadline_unix_ns=job.deadline_unix_ns,
        origin_id=job.origin_id,
        tenant=job.tenant,
        trace=MappingProxyType(dict(job.trace)),
        prefix_key=job.prefix_key,
        resume_samples=MappingProxyType({s.sample: tuple(s.token_ids) for s in job.resume_samples}),
        adapter=job.adapter,
        tools=job.tools,
        cache_salt=job.cache_salt,
    )


def logprobs_from_pb(items: Iterable[Any]) -> tuple[TokenLogprob, ...]:
    """Logprobs from protobuf messages (the internal ones or the public ones)."""
    return tuple(
        TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, top=tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top)
        )
        for lp in items
    )


def logprobs_to_pb(
    items: Sequence[TokenLogprob], token_cls: Callable[..., _M], top_cls: Callable[..., Any]
) -> list[_M]:
    """Logprobs as protobuf messages of the given classes (the internal ones or the public ones)."""
    return [
        token_cls(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[top_cls(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
        )
        for lp in items
    ]


def encode_event(ev: JobEvent) -> bytes:
    msg = pb.JobEvent(
        text=ev.text,
        token_ids=ev.token_ids,
        index=ev.index,
        logprobs=logprobs_to_pb(ev.logprobs, pb.TokenLogprob, pb.TopLogprob),
        tokenized=ev.tokenized,
        worker=ev.worker,
    )
    if ev.sample:  # (n > 1 only: unset fields cost nothing on the hot path)
        msg.sample = ev.sample
    if ev.sample_end is not None:
        msg.sample_end = ev.sample_end.value
    if ev.handed_back:
        msg.handed_back = True
        msg.engine_died = ev.engine_died
    if ev.finished is not None:
        f = ev.finished
        msg.finished.CopyFrom(
            pb.Finished(
                finish_reason=f.finish_reason.value,
                prompt_tokens=f.usage.prompt_tokens,
                completion_tokens=f.usage.completion_tokens,
                cached_tokens=f.usage.cached_tokens,
                started_unix_ns=f.started_unix_ns,
                first_token_unix_ns=f.first_token_unix_ns,
            )
        )
    if ev.failed is not None:
        x = ev.failed
        msg.failed.CopyFrom(pb.Failed(code=x.code, message=x.message, retryable=x.retryable, field=x.field))
    return msg.SerializeToString()


def decode_event(data: bytes) -> JobEvent:
    msg = pb.JobEvent()
    msg.ParseFromString(data)
    finished = failed = None
    if msg.HasField("finished"):
        f = msg.finished
        finished = Finished(
            finish_reason=FinishReason(f.finish_reason),
            usage=Usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens),
            started_unix_ns=f.started_unix_ns,
            first_token_unix_ns=f.first_token_unix_ns,
        )
    if msg.HasField("failed"):
        x = msg.failed
        failed = Failure(code=x.code, message=x.message, retryable=x.retryable, field=x.field)
    return JobEvent(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        index=msg.index,
        logprobs=logprobs_from_pb(msg.logprobs),
        finished=finished,
        failed=failed,
        tokenized=msg.tokenized,
        worker=msg.worker,
        sample=msg.sample,
        sample_end=FinishReason(msg.sample_end) if msg.sample_end else None,
        handed_back=msg.handed_back,
        engine_died=msg.engine_died,
    )


def encode_status(status: WorkerStatus) -> bytes:
    return json.dumps(dataclasses.asdict(status), separators=(",", ":")).encode()


def decode_status(raw: bytes) -> WorkerStatus:
    """A heartbeat's WorkerStatus; fields this version does not know are ignored."""
    data = json.loads(raw)
    known = {f.name for f in dataclasses.fields(WorkerStatus)}
    for name in ("adapters", "adapter_errors", "adapter_paths"):
        if name in data:
            data[name] = tuple(data[name])
    return WorkerStatus(**{k: v for k, v in data.items() if k in known})


def encode_result(r: ItemResult) -> bytes:
    lps = [logprobs_to_pb(x, pb.TokenLogprob, pb.TopLogprob) for x in r.logprobs]
    return pb.ItemResult(
        custom_id=r.custom_id,
        status=r.status.value,
        text=r.text,
        finish_reason=r.finish_reason.value if r.finish_reason is not None else "",
        prompt_tokens=r.usage.prompt_tokens,
        completion_tokens=r.usage.completion_tokens,
        cached_tokens=r.usage.cached_tokens,
        error_code=r.error_code,
        error_message=r.error_message,
        error_field=r.error_field,
        samples=[
            pb.SampleResult(
                text=t, finish_reason=f.value if f is not None else "", logprobs=lps[k] if k < len(lps) else []
            )
            for k, (t, f) in enumerate(r.samples)
        ],
        logprobs=lps[0] if lps and not r.samples else [],  # (n > 1: each sample's in its own)
    ).SerializeToString()


def decode_result(data: bytes) -> ItemResult:
    m = pb.ItemResult()
    m.ParseFromString(data)
    return ItemResult(
        custom_id=m.custom_id,
        status=ItemStatus(m.status),
        text=m.text,
        finish_reason=FinishReason(m.finish_reason) if m.finish_reason else None,
        usage=Usage(m.prompt_tokens, m.completion_tokens, m.cached_tokens),
        error_code=m.error_code,
        error_message=m.error_message,
        error_field=m.error_field,
        samples=tuple((x.text, FinishReason(x.finish_reason) if x.finish_reason else None) for x in m.samples),
        logprobs=_result_logprobs(m),
    )


def _result_logprobs(m: pb.ItemResult) -> tuple[tuple[TokenLogprob, ...], ...]:
    """Each sample's logprobs (empty: none were asked for; sample 0's are the item's own)."""
    if not m.logprobs and not any(s.logprobs for s in m.samples):
        return ()
    if not m.samples:
        return (logprobs_from_pb(m.logprobs),)
    return tuple(logprobs_from_pb(s.logprobs) for s in m.samples)
