"""``gateway_stores.FileStore`` in memory, for tests of one layer (the files live as long as the object)."""

from __future__ import annotations

from collections.abc import Mapping

from llamamesh.types import StoredFile


class MemoryFiles:
    def __init__(self) -> None:
        self._files: dict[tuple[str, str], tuple[StoredFile, bytes]] = {}
        self._links: dict[str, dict[str, str]] = {}

    async def put(self, file: StoredFile, content: bytes, max_total: int = 0) -> int | None:
        held = sum(f.size for f, _ in self._files.values() if f.owner == file.owner)
        if max_total and held + file.size > max_total:
            return held
        self._files[(file.owner, file.file_id)] = (file, bytes(content))
        return None

    async def get(self, owner: str, file_id: str) -> StoredFile | None:
        got = self._files.get((owner, file_id))
        return got[0] if got else None

    async def content(self, owner: str, file_id: str) -> bytes | None:
        got = self._files.get((owner, file_id))
        return got[1] if got else None

    async def delete(self, owner: str, file_id: str) -> bool:
        return self._files.pop((owner, file_id), None) is not None

    async def owned(self, owner: str, limit: int, after: str = "", newest_first: bool = True) -> list[StoredFile]:
        mine = sorted((f for f, _ in self._files.values() if f.owner == owner), key=lambda f: f.created_at)
        if newest_first:
            mine.reverse()
        ids = [f.file_id for f in mine]
        if after and after not in ids:
            return []
        start = ids.index(after) + 1 if after else 0
        return mine[start : start + limit]

    async def link(self, batch_id: str, fields: Mapping[str, str], ttl_s: float) -> None:
        self._links[batch_id] = dict(fields)

    async def linked(self, batch_id: str) -> dict[str, str]:
        return dict(self._links.get(batch_id, {}))
