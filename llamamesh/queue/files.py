"""Uploaded files on Redis (``gateway_stores.FileStore``): one hash per file (``Keys.file``: its record's
fields and its ``content``), kept until deleted; and the HTTP door's facts about the batches it
created (``Keys.batch_link``), kept for the batch's life and retention. A file is at most
``LLAMAMESH_BATCH_MAX_BYTES`` (the door refuses a larger one), so one hash holds it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from llamamesh.queue.keys import Keys
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.scripts import register
from llamamesh.types import StoredFile

RECORD = ("filename", "purpose", "size", "created_at")


class RedisFiles:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._r = client
        self.keys = keys
        self._put = register(client, "put_file")
        self._delete = register(client, "delete_file")
        self._link = register(client, "link_batch")

    async def put(self, file: StoredFile, content: bytes, max_total: int = 0) -> int | None:
        fields: list[Any] = ["filename", file.filename, "purpose", file.purpose, "size", file.size]
        fields += ["created_at", repr(file.created_at), "content", content]
        k = self.keys
        with unreachable():  # (one slot: the owner's hash tag)
            stored, held = await self._put(
                keys=[k.file(file.owner, file.file_id), k.files(file.owner), k.files_bytes(file.owner)],
                args=[file.file_id, repr(file.created_at), file.size, max_total, *fields],
            )
        return None if int(stored) else int(held)

    async def get(self, owner: str, file_id: str) -> StoredFile | None:
        with unreachable():
            raw: Any = await self._r.hmget(self.keys.file(owner, file_id), list(RECORD))
        return _record(owner, file_id, raw)

    async def content(self, owner: str, file_id: str) -> bytes | None:
        with unreachable():
            got: Any = await self._r.hget(self.keys.file(owner, file_id), "content")
        return bytes(got) if got is not None else None

    async def delete(self, owner: str, file_id: str) -> bool:
        k = self.keys
        with unreachable():
            deleted = await self._delete(
                keys=[k.file(owner, file_id), k.files(owner), k.files_bytes(owner)], args=[file_id]
            )
        return bool(deleted)

    async def owned(self, owner: str, limit: int, after: str = "", newest_first: bool = True) -> list[StoredFile]:
        key = self.keys.files(owner)
        with unreachable():
            rank: Any = 0
            if after:
                rank = await (self._r.zrevrank if newest_first else self._r.zrank)(key, after)
                if rank is None:
                    return []
                rank += 1
            ranged = self._r.zrevrange if newest_first else self._r.zrange
            listed: Any = await ranged(key, rank, rank + limit - 1)
            ids = [raw.decode() for raw in listed]
            async with self._r.pipeline(transaction=False) as pipe:
                for file_id in ids:
                    pipe.hmget(self.keys.file(owner, file_id), list(RECORD))
                records: Any = await pipe.execute()
        found = (_record(owner, file_id, raw) for file_id, raw in zip(ids, records, strict=True))
        return [f for f in found if f is not None]

    async def link(self, batch_id: str, fields: Mapping[str, str], ttl_s: float) -> None:
        """Kept ``ttl_s``, or for what is left of the batch's retention once it ended (link_batch.lua)."""
        keys = [self.keys.batch_link(batch_id), self.keys.batch(batch_id)]
        args: list[Any] = [max(1, int(ttl_s)), time.time()]
        for name, value in fields.items():
            args += [name, value]
        with unreachable():
            await self._link(keys=keys, args=args)

    async def linked(self, batch_id: str) -> dict[str, str]:
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.batch_link(batch_id))
        return {k.decode(): v.decode() for k, v in raw.items()}


def _record(owner: str, file_id: str, raw: list[bytes | None]) -> StoredFile | None:
    """A file's record from the HMGET of its ``RECORD`` fields (None: no such file)."""
    if raw[0] is None:
        return None
    name, purpose, size, created = (v.decode() if v is not None else "0" for v in raw)
    return StoredFile(file_id, owner, name, purpose, int(size), float(created))
