"""BatchService: durable batch jobs (validate everything, store, queue the items; then read back).
Validation is services/batch_requests.py's, the store llamamesh/queue/batches.py, the sweep of what
can no longer run services/batch_sweeper.py's; what each RPC promises: docs/api.md ("BatchService").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from types import MappingProxyType

import grpc
import structlog

from llamamesh import errors, tracing
from llamamesh.errors import FieldViolation, InvalidRequest, NotFound, QueueUnavailable
from llamamesh.queue.gateway_stores import Quotas
from llamamesh.queue.protocol import BatchStore
from llamamesh.settings import BatchSettings, GatewaySettings
from llamamesh.tenants import Identity
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ModelInfo, scoped_id
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from services import convert
from services.admission import Admission, access_of, cache_scoped, check_priority
from services.auth import identity
from services.batch_convert import batch_pb, result_pb
from services.batch_requests import DEFAULT_TEMPLATE, batch_requests, stored_size
from services.batch_sweeper import BatchSweeper
from services.calls import note, rpc
from services.normalize import Normalizer
from services.routing import RoutingPolicy

# Names importers take from this module; the modules above own them.
__all__ = ["DEFAULT_TEMPLATE", "BatchServicer", "BatchSweeper", "batch_pb", "batch_requests", "result_pb"]

log = structlog.get_logger(__name__)

CURSOR = re.compile(r"^\d{1,20}-\d{1,20}$")
MAX_PAGE_BYTES = 1 << 20  # ListBatches: a page's batches, at most (a batch's labels are up to 37 KB)

Items = list[tuple[ModelInfo, GenerationRequest]]
Queued = list[tuple[str, GenerationRequest]]  # each item with the pool it goes to


class BatchServicer(batch_pb2_grpc.BatchServiceServicer):
    """The RPC handlers. A batch is validated whole before anything is written, with nothing queued
    when any of it is bad. Items go to their pool's batch stream (workers take them below interactive
    work); results come back through the store. The owner of a batch is the caller's tenant (its
    authenticated identity; without auth the ``x-llamamesh-tenant`` header, else "default"), and
    batch ids are the tenant's own (``scoped_id``): another tenant's batch is NOT_FOUND to Get, List,
    Cancel and results, and the same id may name a batch of each tenant. A batch holds its items and
    bytes of the tenant's budgets (llamamesh/queue/quotas.py) until it ends and until it is purged
    (the sweeper gives them back)."""

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
        tenant_cache: bool = False,
    ) -> None:
        """``adapters_of(pool)``: the LoRA adapters the pool's ready workers serve (None: not known);
        ``tenant_cache``: each tenant's prompts are cached apart (``cache_scoped``)."""
        self._store = store
        self._adapters_of = adapters_of
        self._tenant_cache = tenant_cache
        self._normalizer = normalizer or Normalizer()
        self._admission = admission or Admission(None)
        self._gw = gateway
        self._s = settings
        self._models = tuple(models)
        self._policy = policy or RoutingPolicy(())
        self._block_ms = block_ms

    async def _mine(self, batch_id: str, tenant: str) -> BatchInfo:
        """The tenant's batch ``batch_id`` (the id it chose); NotFound for any other tenant's."""
        if not batch_id:
            raise InvalidRequest.field("batch_id", "required")
        if not convert.REQUEST_ID.match(batch_id):
            raise InvalidRequest.field("batch_id", convert.ID_RULE)
        info = await self._store.get(scoped_id(tenant, batch_id))
        if info is None or info.owner != tenant:
            raise errors.NotFound(await self._unknown(batch_id))
        return info

    async def _unknown(self, batch_id: str) -> str:
        """Why a batch is not found: unknown, its retention ended, or lost with Redis's data (said
        when the data began within a retention: a batch created before then is gone)."""
        why = (
            f"no batch {batch_id!r}: unknown, not accepted (a BatchGenerate that did not return it: send it again, "
            "the same batch_id and items), or its results expired (LLAMAMESH_BATCH_RETENTION_S after it ended)"
        )
        since = await self._store.data_since()
        if since and time.time() - since < self._s.retention_s:
            began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
            why += f", or lost with Redis's data: the queue's data dates from {began}, a batch created before is gone"
        return why

    @rpc("BatchGenerate")
    async def BatchGenerate(self, request: bpb.BatchGenerateRequest, context: grpc.aio.ServicerContext) -> bpb.Batch:
        return await self.submit(request, identity(context))

    async def submit(self, request: bpb.BatchGenerateRequest, who: Identity) -> bpb.Batch:
        """Validate, store and queue ``who``'s batch (either door: the HTTP door builds the request
        from an OpenAI batch file); the same batch_id again returns the stored batch."""
        # The checks and conversion of up to 50 000 items take seconds: off the event loop, whose
        # other calls' streams would stall meanwhile.
        batch_id, info, fingerprint, queued, size = await asyncio.to_thread(self._prepared, request, who)
        await self._admission.request(who)
        stored, new = await self._stored(who, info, fingerprint, queued, size)
        log.info("batch_submitted", batch_id=batch_id, items=len(queued), new=new, owner=info.owner)
        return batch_pb(stored)

    def violations(self, request: bpb.BatchGenerateRequest, who: Identity) -> list[FieldViolation]:
        """What :meth:`submit` would refuse in ``request`` as invalid (nothing is stored)."""
        try:
            batch_requests(request, self._gw, self._s, self._models, who.tenant)
        except InvalidRequest as exc:
            return list(exc.violations)
        except NotFound:  # an unknown model: not a field of its own
            pass
        return []

    def _prepared(self, request: bpb.BatchGenerateRequest, who: Identity) -> tuple[str, BatchInfo, str, Queued, int]:
        """The batch's id, record, fingerprint, items as queued (each with its pool), checked, and the
        bytes it keeps (``stored_size``: a summarisation's documents written out, counted here, off
        the event loop)."""
        batch_id, window, items = batch_requests(request, self._gw, self._s, self._models, who.tenant)
        items = self._admitted(who, items, "summarise.documents" if request.summarise.documents else "items")
        scoped = scoped_id(who.tenant, batch_id)
        now = time.time()
        info = BatchInfo(
            batch_id=scoped,
            state=BatchState.VALIDATING,
            owner=who.tenant,
            model=items[0][0].id,
            total=len(items),
            completion_window_s=window,
            created_at=now,
            expires_at=now + window,
            metadata=MappingProxyType(dict(request.metadata)),
        )
        fingerprint = hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        access = access_of(who)
        trace = tracing.carrier()  # this RPC's span: every item's job span is its child
        if self._tenant_cache:
            items = [(model, cache_scoped(req, who.tenant)) for model, req in items]
        queued = [(self._policy.choose(req, model.pool, access)[0], replace(req, trace=trace)) for model, req in items]
        return batch_id, info, fingerprint, queued, stored_size(request)

    def _admitted(self, who: Identity, items: Items, named: str) -> Items:
        """The items normalised (services/normalize.py: before routing and storing; the fingerprint
        is of what was sent), each checked for the caller's priority and its adapter. Raises
        PermissionDenied or NotFound naming the item (``named[n]``); nothing is written."""
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
                raise errors.PermissionDenied(f"{named}[{n}] ({req.custom_id!r}): {exc.message}") from None
            except errors.NotFound as exc:  # nothing is written
                raise errors.NotFound(f"{named}[{n}] ({req.custom_id!r}): {exc.message}") from None
        note(tenant=who.tenant, normalized_items=rewritten or None)
        return items

    async def _stored(
        self,
        who: Identity,
        info: BatchInfo,
        fingerprint: str,
        queued: list[tuple[str, GenerationRequest]],
        size: int,
    ) -> tuple[BatchInfo, bool]:
        """Store the batch and queue its items, within the tenant's budgets: (the batch as stored,
        whether it is new). A batch that was not stored holds nothing of the budgets; one stored
        though its call failed (after its seal, or cancelled then) keeps its hold, which the sweep
        gives back when it ends, like any other's."""
        quotas = self._admission.quotas
        held = False
        if quotas is not None:
            held = await quotas.reserve_batch(who.tenant, who.limits, info.batch_id, len(queued), size, fingerprint)
        try:
            return await self._store.create(info, fingerprint, queued)
        except BaseException:
            if held and quotas is not None:
                await asyncio.shield(self._unreserve_unstored(quotas, who.tenant, info.batch_id))
            raise

    async def _unreserve_unstored(self, quotas: Quotas, tenant: str, batch_id: str) -> None:
        """Give back what a batch whose call failed reserved, unless it is stored after all (Redis
        out: kept, for the sweep to give back once it finds no record)."""
        with contextlib.suppress(QueueUnavailable):
            if not await self._store.stored(batch_id):  # (a cut-off one's retry may yet seal it: held)
                await quotas.unreserve_batch(tenant, batch_id)

    @rpc("GetBatch")
    async def GetBatch(self, request: bpb.GetBatchRequest, context: grpc.aio.ServicerContext) -> bpb.Batch:
        return await self.get(request.batch_id, identity(context))

    async def get(self, batch_id: str, who: Identity) -> bpb.Batch:
        return batch_pb(await self._mine(batch_id, who.tenant))

    @rpc("ListBatches")
    async def ListBatches(
        self, request: bpb.ListBatchesRequest, context: grpc.aio.ServicerContext
    ) -> bpb.ListBatchesResponse:
        return await self.page(identity(context), request.page_size or 20, request.page_token)

    async def page(self, who: Identity, size: int, token: str) -> bpb.ListBatchesResponse:
        """``who``'s batches, newest first, ``size`` of them from ``token`` (a page's next_page_token)."""
        if not 1 <= size <= 100:
            raise InvalidRequest.field("page_size", "1-100")
        before: float | None = None
        if token:
            try:
                before = float(token)
            except ValueError:
                before = math.nan
            if not math.isfinite(before):  # "nan" and "inf" parse as floats, Redis takes neither
                raise InvalidRequest.field("page_token", "not a token from ListBatches") from None
        got = await self._store.owned(who.tenant, size + 1, before)
        page: list[bpb.Batch] = []
        held = 0
        for info in got[:size]:  # a page ends early rather than outgrow a client's 4 MiB message limit
            msg = batch_pb(info)
            held += msg.ByteSize()
            if page and held > MAX_PAGE_BYTES:
                break
            page.append(msg)
        following = repr(got[len(page) - 1].created_at) if len(got) > len(page) else ""
        return bpb.ListBatchesResponse(batches=page, next_page_token=following)

    @rpc("CancelBatch")
    async def CancelBatch(self, request: bpb.CancelBatchRequest, context: grpc.aio.ServicerContext) -> bpb.Batch:
        return await self.cancel(request.batch_id, identity(context))

    async def cancel(self, batch_id: str, who: Identity) -> bpb.Batch:
        mine = await self._mine(batch_id, who.tenant)
        info = await self._store.cancel(mine.batch_id)
        if info is None:
            raise errors.NotFound(await self._unknown(batch_id))
        log.info("batch_cancel_requested", batch_id=batch_id, state=info.state.value)
        return batch_pb(info)

    @rpc("StreamBatchResults")
    async def StreamBatchResults(
        self, request: bpb.StreamBatchResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bpb.BatchResult]:
        follow = request.follow if request.HasField("follow") else True
        who = identity(context)
        results = self.results(request.batch_id, who, request.cursor, follow)
        # One of the tenant's streams (max_streams) while it is open: a follower can wait for hours.
        async with self._admission.stream(who), contextlib.aclosing(results) as stream:
            async for r in stream:
                yield r

    async def results(
        self, batch_id: str, who: Identity, cursor: str, follow: bool
    ) -> AsyncGenerator[bpb.BatchResult, None]:
        """Results after the cursor as they come; with follow, until the batch ended and every
        result was sent."""
        info = await self._mine(batch_id, who.tenant)
        cursor = cursor or "0-0"
        if not CURSOR.match(cursor):
            raise InvalidRequest.field("cursor", "not a BatchResult.cursor")
        # An item's result once per stream: a result Redis lost after it was sent is recorded again
        # when its item runs again, under a later cursor.
        sent: set[str] = set()
        while True:
            ended = info.state.ended
            got = await self._store.results(info.batch_id, cursor, self._block_ms if follow and not ended else None)
            for cursor, result in got:
                if result.custom_id not in sent:
                    sent.add(result.custom_id)
                    yield result_pb(info.batch_id, cursor, result)
            if not got and (ended or not follow):
                return
            if not got:  # nothing within block_ms: has the batch ended meanwhile?
                info = await self._mine(batch_id, who.tenant)
