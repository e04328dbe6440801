"""BatchService: durable batch jobs (validate everything, store, queue the items; then read back).

A batch is validated whole before anything is written: a bad item, a duplicate custom_id, an
empty, too large or oversized batch is INVALID_ARGUMENT naming the field, with nothing queued.
Items go to their pool's batch stream (workers take them below interactive work); results come
back through the store (llamamesh/queue/batches.py). The owner of a batch is the caller's tenant
(its authenticated identity; without auth the ``x-llamamesh-tenant`` header, else "default"), and
batch ids are the tenant's own (``scoped_id``): another tenant's batch is NOT_FOUND to Get, List,
Cancel and results, and the same id may name a batch of each tenant. A batch holds its items and
bytes of the tenant's budgets (llamamesh/queue/quotas.py) until it ends and until it is purged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from types import MappingProxyType

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from llamamesh import errors, metrics, tracing
from llamamesh.errors import FieldViolation, InvalidRequest, QueueUnavailable
from llamamesh.queue.protocol import BatchStore
from llamamesh.queue.quotas import UNSTORED_GRACE_S, Quotas
from llamamesh.settings import BatchSettings, GatewaySettings
from llamamesh.types import (
    DEFAULT_TENANT,
    BatchInfo,
    BatchState,
    GenerationRequest,
    ItemResult,
    ItemStatus,
    ModelInfo,
    public_id,
    scoped_id,
)
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from services import convert, status
from services.admission import Admission, access_of, check_priority
from services.auth import identity
from services.calls import note, rpc
from services.normalize import Normalizer
from services.routing import RoutingPolicy

log = structlog.get_logger(__name__)

DEFAULT_TEMPLATE = "Summarise the following document in a few sentences.\n\n{document}"
MAX_CUSTOM_ID = 128
MIN_WINDOW_S = 10
CURSOR = re.compile(r"^\d{1,20}-\d{1,20}$")

_STATE_TO_PB = {s: getattr(bpb, f"BATCH_STATE_{s.name}") for s in BatchState}
_STATUS_TO_PB = {
    "succeeded": bpb.BATCH_ITEM_STATUS_SUCCEEDED,
    "errored": bpb.BATCH_ITEM_STATUS_ERRORED,
    "cancelled": bpb.BATCH_ITEM_STATUS_CANCELLED,
    "expired": bpb.BATCH_ITEM_STATUS_EXPIRED,
}


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
            del req.messages[:]
            req.messages.append(pb.ChatMessage(role="user", content=template.replace("{document}", d.text)))
            out.append((f"summarise.documents[{i}]", d.custom_id, req))
        return out
    return [(f"items[{i}]", item.custom_id, item.request) for i, item in enumerate(r.items)]


def _item_violation(path: str, v: FieldViolation) -> FieldViolation:
    """A violation of one item's request, named where the caller wrote it: under the item, or for a
    summarisation, once under summarise.params (the documents share it), except the document itself."""
    if not path.startswith("summarise"):
        return FieldViolation(f"{path}.request.{v.field}", v.description)
    if v.field.startswith("messages"):
        return FieldViolation(f"{path}.text", v.description)
    return FieldViolation(f"summarise.params.{v.field}", v.description)


def batch_requests(
    r: bpb.BatchGenerateRequest, gw: GatewaySettings, b: BatchSettings, models: Sequence[ModelInfo],
    tenant: str = DEFAULT_TENANT,
) -> tuple[str, int, list[tuple[ModelInfo, GenerationRequest]]]:  # fmt: skip
    """Validate a whole BatchGenerateRequest: (batch id as the caller knows it, completion window,
    items of ``tenant``). Raises InvalidRequest naming every bad field (or NotFound for an unknown
    model); nothing is written. Item ids (``b~<scoped batch id>~<n>``) meet no caller's id."""
    bad: list[FieldViolation] = []
    batch_id = r.batch_id or uuid.uuid4().hex
    if not convert.REQUEST_ID.match(batch_id):
        bad.append(FieldViolation("batch_id", "1-128 characters of A-Z a-z 0-9 . _ : -"))
    window = r.completion_window_s if r.HasField("completion_window_s") else b.completion_window_s
    if window < MIN_WINDOW_S:
        bad.append(FieldViolation("completion_window_s", f"at least {MIN_WINDOW_S} seconds"))
    size = r.ByteSize()
    if size > b.max_bytes:
        bad.append(FieldViolation("items", f"the batch is {size} bytes; at most {b.max_bytes}"))
    raw = _requests_of(r, bad)
    if not raw and not bad:
        bad.append(FieldViolation("items", "a batch needs at least one item (items or summarise.documents)"))
    if len(raw) > b.max_items:
        bad.append(FieldViolation("items", f"{len(raw)} items; at most {b.max_items}"))
    seen: dict[str, str] = {}
    out: list[tuple[ModelInfo, GenerationRequest]] = []
    for n, (path, custom_id, request) in enumerate(raw):
        if not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            bad.append(FieldViolation(f"{path}.custom_id", f"1-{MAX_CUSTOM_ID} characters"))
        elif custom_id in seen:
            bad.append(FieldViolation(f"{path}.custom_id", f"duplicate of {seen[custom_id]}.custom_id"))
        else:
            seen[custom_id] = path
        if len(bad) > 20:  # enough to act on
            break
        try:
            req, model = convert.generate_request(request, gw, models)
        except InvalidRequest as exc:
            bad.extend(v for v in (_item_violation(path, v) for v in exc.violations) if v not in bad)
            continue
        if out and model.id != out[0][0].id:
            bad.append(FieldViolation(f"{path}.request.model", f"every item must use one model ({out[0][0].id})"))
            continue
        scoped = scoped_id(tenant, batch_id)
        out.append((model, replace(req, request_id=f"b~{scoped}~{n}", batch_id=scoped, custom_id=custom_id,
                                   tenant="" if tenant == DEFAULT_TENANT else tenant)))  # fmt: skip
    if bad:
        raise InvalidRequest(bad)
    return batch_id, window, out


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
    )
    for state, when in info.times.items():
        ts = _ts(when)
        if ts is not None and hasattr(msg, f"{state}_at"):
            getattr(msg, f"{state}_at").CopyFrom(ts)
    for name, when in (("created_at", info.created_at), ("expires_at", info.expires_at),
                       ("results_expire_at", info.results_expire_at)):  # fmt: skip
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
        cursor=cursor,
    )
    if r.finish_reason is not None:
        msg.finish_reason = convert.FINISH_TO_PB[r.finish_reason]
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=r.usage.prompt_tokens, completion_tokens=r.usage.completion_tokens))
    for text, finish in r.samples:
        msg.samples.add(text=text, finish_reason=convert.FINISH_TO_PB[finish] if finish is not None else 0)
    return msg


class BatchServicer(batch_pb2_grpc.BatchServiceServicer):
    def __init__(
        self,
        store: BatchStore,
        gateway: GatewaySettings,
        settings: BatchSettings,
        models: Sequence[ModelInfo],
        policy: RoutingPolicy | None = None,
        block_ms: int = 2000,
        admission: Admission | None = None,
        normalizer: Normalizer | None = None,
        adapters_of: Callable[[str], frozenset[str] | None] = lambda pool: None,
    ) -> None:
        """``adapters_of(pool)``: the LoRA adapters the pool's ready workers serve (None: not known)."""
        self._store = store
        self._adapters_of = adapters_of
        self._normalizer = normalizer or Normalizer()
        self._admission = admission or Admission(None)
        self._gw = gateway
        self._s = settings
        self._models = tuple(models)
        self._policy = policy or RoutingPolicy(())
        self._block_ms = block_ms

    async def _mine(self, batch_id: str, context: grpc.aio.ServicerContext) -> BatchInfo:
        """The caller's batch ``batch_id`` (the id it chose); NotFound for any other tenant's."""
        if not batch_id:
            raise InvalidRequest.field("batch_id", "required")
        if not convert.REQUEST_ID.match(batch_id):
            raise InvalidRequest.field("batch_id", "1-128 characters of A-Z a-z 0-9 . _ : -")
        tenant = identity(context).tenant
        info = await self._store.get(scoped_id(tenant, batch_id))
        if info is None or info.owner != tenant:
            raise errors.NotFound(await self._unknown(batch_id))
        return info

    async def _unknown(self, batch_id: str) -> str:
        """Why a batch is not found: unknown, its retention ended, or lost with Redis's data (said
        when the data began within a retention: a batch created before then is gone)."""
        why = f"no batch {batch_id!r}: unknown, or its results expired (LLAMAMESH_BATCH_RETENTION_S after it ended)"
        since = await self._store.data_since()
        if since and time.time() - since < self._s.retention_s:
            began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
            why += f", or lost with Redis's data: the queue's data dates from {began}, a batch created before is gone"
        return why

    @rpc("BatchGenerate")
    async def BatchGenerate(self, request: bpb.BatchGenerateRequest, context: grpc.aio.ServicerContext) -> bpb.Batch:
        who = identity(context)
        batch_id, window, items = batch_requests(request, self._gw, self._s, self._models, who.tenant)
        # Normalised (services/normalize.py) before routing and storing; the fingerprint is of what was sent.
        rewritten = 0
        for n, (model, req) in enumerate(items):
            out = self._normalizer.apply(req)
            rewritten += out is not req
            items[n] = (model, out)
        for n, (model, req) in enumerate(items):
            try:
                check_priority(who, req.priority)
                convert.check_adapter(req.adapter, model, self._adapters_of)
            except errors.PermissionDenied as exc:
                raise errors.PermissionDenied(f"item {n} ({req.custom_id!r}): {exc.message}") from None
            except errors.NotFound as exc:  # nothing is written
                raise errors.NotFound(f"item {n} ({req.custom_id!r}): {exc.message}") from None
        note(tenant=who.tenant, normalized_items=rewritten or None)
        scoped = scoped_id(who.tenant, batch_id)
        now = time.time()
        info = BatchInfo(
            batch_id=scoped, state=BatchState.VALIDATING, owner=who.tenant, model=items[0][0].id,
            total=len(items), completion_window_s=window, created_at=now, expires_at=now + window,
            metadata=MappingProxyType(dict(request.metadata)),
        )  # fmt: skip
        fingerprint = hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        access = access_of(who)
        trace = tracing.carrier()  # this RPC's span: every item's job span is its child
        queued = [(self._policy.choose(req, model.pool, access)[0], replace(req, trace=trace)) for model, req in items]
        await self._admission.request(who)
        quotas = self._admission.quotas
        held = False
        if quotas is not None:
            held = await quotas.reserve_batch(who.tenant, who.limits, scoped, len(items), request.ByteSize())
        try:
            stored, new = await self._store.create(info, fingerprint, queued)
        except BaseException:
            if held and quotas is not None:  # not stored: what it reserved is free again
                with contextlib.suppress(QueueUnavailable):
                    await asyncio.shield(quotas.unreserve_batch(who.tenant, scoped))
            raise
        log.info("batch_submitted", batch_id=batch_id, items=len(items), new=new, owner=info.owner)
        return batch_pb(stored)

    @rpc("GetBatch")
    async def GetBatch(self, request: bpb.GetBatchRequest, context: grpc.aio.ServicerContext) -> bpb.Batch:
        return batch_pb(await self._mine(request.batch_id, context))

    @rpc("ListBatches")
    async def ListBatches(
        self, request: bpb.ListBatchesRequest, context: grpc.aio.ServicerContext
    ) -> bpb.ListBatchesResponse:
        size = request.page_size or 20
        if not 1 <= size <= 100:
            raise InvalidRequest.field("page_size", "1-100")
        before: float | None = None
        if request.page_token:
            try:
                before = float(request.page_token)
            except ValueError:
                before = math.nan
            if not math.isfinite(before):  # "nan" and "inf" parse as floats, Redis takes neither
                raise InvalidRequest.field("page_token", "not a token from ListBatches") from None
        got = await self._store.owned(identity(context).tenant, size + 1, before)
        more = len(got) > size
        page = got[:size]
        return bpb.ListBatchesResponse(
            batches=[batch_pb(b) for b in page], next_page_token=repr(page[-1].created_at) if more else ""
        )

    @rpc("CancelBatch")
    async def CancelBatch(self, request: bpb.CancelBatchRequest, context: grpc.aio.ServicerContext) -> bpb.Batch:
        mine = await self._mine(request.batch_id, context)
        info = await self._store.cancel(mine.batch_id)
        if info is None:
            raise errors.NotFound(await self._unknown(request.batch_id))
        log.info("batch_cancel_requested", batch_id=request.batch_id, state=info.state.value)
        return batch_pb(info)

    @rpc("StreamBatchResults")
    async def StreamBatchResults(
        self, request: bpb.StreamBatchResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bpb.BatchResult]:
        """Results after the cursor as they come; with follow (default), until the batch ended and
        every result was sent."""
        info = await self._mine(request.batch_id, context)
        follow = request.follow if request.HasField("follow") else True
        cursor = request.cursor or "0-0"
        if not CURSOR.match(cursor):
            raise InvalidRequest.field("cursor", "not a BatchResult.cursor")
        while True:
            ended = info.state.ended
            got = await self._store.results(info.batch_id, cursor, self._block_ms if follow and not ended else None)
            for cursor, result in got:
                yield result_pb(info.batch_id, cursor, result)
            if not got and (ended or not follow):
                return
            if not got:  # nothing within block_ms: has the batch ended meanwhile?
                info = await self._mine(request.batch_id, context)


class BatchSweeper:
    """Ends, every ``interval_s``, whether or not a worker runs, what can no longer run: the unstarted
    items of batches past their deadline, and the items a dead worker left leased in those and in
    cancelled or failed batches (workers expire the items they lease late too); and gives back
    what ended and purged batches held of their tenants' budgets. Every gateway runs
    one: a sweep is safe to repeat and to race."""

    def __init__(
        self, store: BatchStore, interval_s: float, quotas: Quotas | None = None, retention_s: float = UNSTORED_GRACE_S
    ) -> None:
        self._store = store
        self._quotas = quotas
        # A batch hold with no record is a purged batch once older than this (or one being stored).
        self._grace_s = min(UNSTORED_GRACE_S, retention_s)
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-sweeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self._store.sweep()
                metrics.BATCHES_AT_RISK.set(await self._store.at_risk(metrics.AT_RISK_FRACTION))
                if self._quotas is not None:  # what ended batches held of their tenants' budgets
                    await self._quotas.give_back(self._grace_s)
            except QueueUnavailable:
                log.warning("batch_sweep_failed", retry_in_s=self._interval_s)
            except Exception:  # a sweep must never kill the gateway
                log.exception("batch_sweep_crashed")
            await asyncio.sleep(self._interval_s)
