"""Batches and their results as the public protos (pure functions: the batch service's twin of
services/convert.py)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from llamamesh import errors
from llamamesh.queue import codec
from llamamesh.types import BatchInfo, BatchState, ItemResult, ItemStatus, public_id
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from services import convert, status

_STATE_TO_PB = {s: getattr(bpb, f"BATCH_STATE_{s.name}") for s in BatchState}
_STATUS_TO_PB = {
    "succeeded": bpb.BATCH_ITEM_STATUS_SUCCEEDED,
    "errored": bpb.BATCH_ITEM_STATUS_ERRORED,
    "cancelled": bpb.BATCH_ITEM_STATUS_CANCELLED,
    "expired": bpb.BATCH_ITEM_STATUS_EXPIRED,
}


def _ts(seconds: float) -> Timestamp | None:
    if not seconds:
        return None
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def batch_pb(info: BatchInfo) -> bpb.Batch:
    msg = bpb.Batch(
        batch_id=public_id(info.batch_id),
        state=_STATE_TO_PB[info.state],
        counts=bpb.BatchCounts(
            total=info.total,
            processing=info.processing,
            succeeded=info.succeeded,
            errored=info.errored,
            cancelled=info.cancelled,
            expired=info.expired,
        ),
        owner=info.owner,
        model=info.model,
        metadata=dict(info.metadata),
        completion_window_s=info.completion_window_s,
        usage=bpb.BatchUsage(
            prompt_tokens=info.prompt_tokens,
            completion_tokens=info.completion_tokens,
            total_tokens=info.prompt_tokens + info.completion_tokens,
            cached_tokens=info.cached_tokens,
        ),
    )
    for state, when in info.times.items():
        ts = _ts(when)
        if ts is not None and hasattr(msg, f"{state}_at"):
            getattr(msg, f"{state}_at").CopyFrom(ts)
    for name, when in (
        ("created_at", info.created_at),
        ("expires_at", info.expires_at),
        ("results_expire_at", info.results_expire_at),
    ):
        ts = _ts(when)
        if ts is not None:
            getattr(msg, name).CopyFrom(ts)
    return msg


# The error codes of items that never ran (ItemResult.unrun), as gRPC status names.
_UNRUN_STATUS = {ItemStatus.CANCELLED.value: "CANCELLED", ItemStatus.EXPIRED.value: "DEADLINE_EXCEEDED"}


def _status_name(code: str) -> str:
    """The gRPC status name of a stored item error (a domain error code, or an unrun item's status)."""
    if not code:
        return ""
    return _UNRUN_STATUS.get(code) or status.code_for(errors.from_code(code, "")).name


def result_pb(batch_id: str, cursor: str, r: ItemResult) -> bpb.BatchResult:
    msg = bpb.BatchResult(
        batch_id=public_id(batch_id),
        custom_id=r.custom_id,
        status=_STATUS_TO_PB[r.status.value],
        text=r.text,
        error_code=_status_name(r.error_code),
        error_reason=r.error_code.upper(),
        error_message=r.error_message,
        error_field=r.error_field,
        cursor=cursor,
    )
    if r.finish_reason is not None:
        msg.finish_reason = convert.FINISH_TO_PB[r.finish_reason]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=r.usage.prompt_tokens, completion_tokens=r.usage.completion_tokens))
    lps = [codec.logprobs_to_pb(x, pb.TokenLogprob, pb.TopLogprob) for x in r.logprobs]
    for k, (text, finish) in enumerate(r.samples):
        end = convert.FINISH_TO_PB[finish] if finish is not None else 0
        msg.samples.add(text=text, finish_reason=end, logprobs=lps[k] if k < len(lps) else [])
    if lps and not r.samples:  # (n > 1: each sample's in its own, not twice)
        msg.logprobs.extend(lps[0])
    return msg
