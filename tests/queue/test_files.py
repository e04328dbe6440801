"""Uploaded files (``FileStore``) on each real server kind and in memory: each owner's own, listed in
upload order a page at a time, gone from the list once deleted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from llamamesh.queue.files import RedisFiles
from llamamesh.queue.gateway_stores import FileStore
from llamamesh.queue.memory import MemoryFiles
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import StoredFile

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["redis", "memory"])
async def files(request: pytest.FixtureRequest, redis_settings: RedisSettings) -> AsyncIterator[FileStore]:
    if request.param == "memory":
        yield MemoryFiles()
        return
    q = RedisQueue.from_settings(redis_settings)
    yield RedisFiles(q.client, q.keys)
    await q.close()


async def test_files_are_their_owners_and_listed_in_upload_order(files: FileStore) -> None:
    for n in range(5):
        await files.put(StoredFile(f"file-{n}", "acme", f"f{n}.jsonl", "batch", n + 1, 1000.0 + n), b"x" * (n + 1))
    await files.put(StoredFile("file-b", "beta", "b.jsonl", "batch", 1, 2000.0), b"b")
    assert await files.get("beta", "file-0") is None and await files.content("beta", "file-0") is None
    got = await files.get("acme", "file-3")
    assert got is not None and (got.filename, got.size, got.created_at) == ("f3.jsonl", 4, 1003.0)

    async def ids(limit: int, after: str = "", newest_first: bool = True) -> list[str]:
        return [f.file_id for f in await files.owned("acme", limit, after, newest_first)]

    assert await ids(10) == ["file-4", "file-3", "file-2", "file-1", "file-0"]
    assert await ids(2) == ["file-4", "file-3"] and await ids(2, "file-3") == ["file-2", "file-1"]
    assert await ids(2, "file-1", newest_first=False) == ["file-2", "file-3"]
    assert await ids(2, "file-b") == []  # another owner's id: no place in this list
    assert await files.delete("acme", "file-2") and not await files.delete("acme", "file-2")
    assert await ids(10) == ["file-4", "file-3", "file-1", "file-0"]
    assert [f.file_id for f in await files.owned("beta", 10)] == ["file-b"]


async def test_an_owners_files_hold_at_most_its_bytes_and_a_deletion_frees_them(files: FileStore) -> None:
    def upload(n: int, size: int, owner: str = "acme") -> StoredFile:
        return StoredFile(f"file-{owner}-{n}", owner, "f.jsonl", "batch", size, 1000.0 + n)

    assert await files.put(upload(0, 60), b"x" * 60, max_total=100) is None
    assert await files.put(upload(1, 50), b"x" * 50, max_total=100) == 60  # refused: 60 held, 110 > 100
    assert await files.get("acme", "file-acme-1") is None
    assert await files.put(upload(2, 40), b"x" * 40, max_total=100) is None  # exactly 100
    assert await files.put(upload(0, 100, owner="beta"), b"b" * 100, max_total=100) is None  # its own bytes
    assert await files.delete("acme", "file-acme-0")
    assert await files.put(upload(3, 60), b"x" * 60, max_total=100) is None  # 40 + 60 after the deletion
    assert await files.put(upload(4, 10**6), b"", max_total=0) is None  # 0: no bound
