"""What only the gateway keeps in Redis beside the queue: every tenant's budgets (``Quotas``:
``quotas.RedisQuotas``) and the files tenants upload (``FileStore``: ``files.RedisFiles``); the
in-memory fakes with the same contracts are in ``memory``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from llamamesh.queue.keys import UNSTORED_GRACE_S
from llamamesh.settings import LimitsSettings
from llamamesh.types import StoredFile


class Quotas(Protocol):
    """Every tenant's budgets, shared by all gateways (``quotas.RedisQuotas``)."""

    async def admit(self, tenant: str, limits: LimitsSettings, reserve: int = 0) -> None:
        """Take one request from the tenant's request bucket and ``reserve`` tokens from its token
        bucket, if that is above zero. Raises RateLimited (nothing taken) or QueueUnavailable."""

    async def spend(self, tenant: str, limits: LimitsSettings, tokens: int) -> None:
        """Take ``tokens`` (what a request generated less what it reserved; below zero: given back)
        off the tenant's token bucket."""

    async def open_stream(self, tenant: str, limits: LimitsSettings, stream_id: str) -> None:
        """Hold one of the tenant's concurrent streams; raises RateLimited when all are held."""

    async def close_stream(self, tenant: str, stream_id: str) -> None: ...

    async def renew_streams(self, held: Mapping[str, str]) -> None:
        """Extend the leases of the streams this gateway holds (stream id -> tenant)."""

    async def reserve_batch(
        self, tenant: str, limits: LimitsSettings, batch_id: str, items: int, size: int, fingerprint: str = "-"
    ) -> bool:
        """Hold a new batch's items and bytes; False when this batch (``fingerprint``: its items)
        holds them already. Raises RateLimited when the tenant's items or bytes would go over, and
        AlreadyExists when other items hold them under this id."""
        ...

    async def unreserve_batch(self, tenant: str, batch_id: str) -> None:
        """Give back all a batch held (it was not stored after all)."""

    async def give_back(self, grace_s: float = UNSTORED_GRACE_S) -> int:
        """Give back what ended batches held (items) and purged ones (bytes: a hold without a batch
        record, once older than ``grace_s``); how many changed."""
        ...


class FileStore(Protocol):
    """Files tenants upload (the HTTP door's batch inputs), each its owner's only, and what the door
    keeps beside a batch it made. ``files.RedisFiles`` on Redis; ``memory.MemoryFiles`` in memory."""

    async def put(self, file: StoredFile, content: bytes, max_total: int = 0) -> int | None:
        """Store the file, unless its owner's files would then hold more than ``max_total`` bytes
        (0: no bound): None when stored, else the bytes they hold already."""
        ...

    async def get(self, owner: str, file_id: str) -> StoredFile | None:
        """The owner's file (None: unknown, deleted, or another tenant's)."""
        ...

    async def content(self, owner: str, file_id: str) -> bytes | None: ...

    async def delete(self, owner: str, file_id: str) -> bool:
        """False when the owner had no file of that id."""
        ...

    async def owned(self, owner: str, limit: int, after: str = "", newest_first: bool = True) -> list[StoredFile]:
        """Up to ``limit`` of the owner's files in upload order (``newest_first``: the latest first),
        those after the file ``after`` (an id of theirs; "": from the start; unknown: none)."""
        ...

    async def link(self, batch_id: str, fields: Mapping[str, str], ttl_s: float) -> None:
        """Keep ``fields`` beside the (scoped) batch for ``ttl_s`` seconds (its whole life)."""
        ...

    async def linked(self, batch_id: str) -> dict[str, str]: ...
