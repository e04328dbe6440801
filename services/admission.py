"""Admission: a tenant's budgets as the RPC handlers use them, before anything is queued (the counting
is in Redis, llamamesh/queue/quotas.py, shared by every gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator

import structlog

from llamamesh import errors, metrics
from llamamesh.loop import cancel_and_wait
from llamamesh.queue.gateway_stores import Quotas
from llamamesh.queue.keys import STREAM_LEASE_MS
from llamamesh.tenants import Identity
from llamamesh.types import GenerationRequest, tenant_salt
from services.routing import Access

log = structlog.get_logger(__name__)


def access_of(who: Identity) -> Access:
    """The pools and tier routing may use for ``who``."""
    return Access(who.limits.tier, frozenset(p.strip() for p in who.limits.pools.split(",") if p.strip()))


def check_priority(who: Identity, priority: int) -> None:
    """PermissionDenied above the tenant's highest priority."""
    most = who.limits.max_priority
    if priority > most:
        metrics.rejected(reason="permission_denied")
        raise errors.PermissionDenied(
            f"priority {priority} is above tenant {who.tenant!r}'s highest, {most} (LLAMAMESH_LIMITS_MAX_PRIORITY)"
        )


def check_streams(who: Identity, streams: int, field: str, what: str) -> None:
    """InvalidRequest naming ``field`` when one call (``what``) holds ``streams`` of the tenant's concurrent
    streams, more than its max_streams: it could never be admitted, so it is refused as invalid, not as
    RateLimited (which says to retry)."""
    most = who.limits.max_streams
    if most > 0 and streams > most:
        raise errors.InvalidRequest.field(
            field,
            f"{what}, each a stream of its own; tenant {who.tenant!r} may hold at most "
            f"{most} streams at once (max_streams, LLAMAMESH_LIMITS_MAX_STREAMS)",
        )


def cache_scoped(req: GenerationRequest, tenant: str) -> GenerationRequest:
    """``req`` with the prefix cache its tenant's own: the engine's cache salt from the tenant, and
    its prefix-affinity key (a prefix's worker) keyed by it too, so that two tenants' identical
    prompts are routed and cached apart. A request with no affinity key keeps none."""
    salt = tenant_salt(tenant)
    key = f"{salt}:{req.prefix_key}" if req.prefix_key else ""
    return dataclasses.replace(req, cache_salt=salt, prefix_key=key)


class Admission:
    """One gateway's admission (none without ``quotas``): it owns the task that renews the leases of
    the streams it holds, started by ``start`` and cancelled by ``stop``. Over a budget: RateLimited
    (RESOURCE_EXHAUSTED with RetryInfo)."""

    def __init__(self, quotas: Quotas | None) -> None:
        self.quotas = quotas
        self._held: dict[str, str] = {}  # stream id -> tenant
        self._renewer: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.quotas is not None:
            self._renewer = asyncio.create_task(self._renew(), name="stream-leases")

    async def stop(self) -> None:
        await cancel_and_wait(self._renewer)

    async def _renew(self) -> None:
        assert self.quotas is not None
        while True:
            await asyncio.sleep(STREAM_LEASE_MS / 3000)
            try:
                await self.quotas.renew_streams(dict(self._held))
            except errors.QueueUnavailable:
                log.warning("stream_leases_not_renewed", streams=len(self._held))

    async def request(self, who: Identity, reserve: int = 0) -> None:
        """One request against the tenant's requests-per-second and tokens-per-minute, reserving
        ``reserve`` tokens (the most it may generate) until ``spent`` settles it."""
        if self.quotas is not None:
            try:
                await self.quotas.admit(who.tenant, who.limits, reserve)
            except errors.RateLimited as exc:
                metrics.rejected(exc)
                raise

    @contextlib.asynccontextmanager
    async def stream(self, who: Identity) -> AsyncIterator[None]:
        """Hold one of the tenant's concurrent streams for the ``async with`` block; this gateway
        renews its lease meanwhile, so a gateway that dies frees it. Released (shielded) on the way
        out, cancellation included."""
        if self.quotas is None or who.limits.max_streams <= 0:
            yield
            return
        stream_id = uuid.uuid4().hex
        try:
            await self.quotas.open_stream(who.tenant, who.limits, stream_id)
        except errors.RateLimited as exc:
            metrics.rejected(exc)
            raise
        self._held[stream_id] = who.tenant
        try:
            yield
        finally:
            self._held.pop(stream_id, None)
            with contextlib.suppress(errors.QueueUnavailable):  # its lease then ends by itself
                await asyncio.shield(self.quotas.close_stream(who.tenant, stream_id))

    async def spent(self, who: Identity, tokens: int, reserved: int = 0) -> None:
        """What a request generated, settled against what it reserved on the tenant's token budget
        (shielded; with Redis out it is logged, not counted)."""
        if self.quotas is None or tokens == reserved:
            return
        try:
            await asyncio.shield(self.quotas.spend(who.tenant, who.limits, tokens - reserved))
        except errors.QueueUnavailable:
            log.warning("tokens_not_counted", tenant=who.tenant, tokens=tokens)
