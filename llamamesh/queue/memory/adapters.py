"""The run-time LoRA adapters of each pool, in memory."""

from __future__ import annotations

from llamamesh.queue.memory.state import MemoryState


class MemoryAdapters(MemoryState):
    async def adapters(self, pool: str) -> dict[str, str]:
        self._check()
        return dict(self._adapters.get(pool, {}))

    async def set_adapter(self, pool: str, name: str, path: str) -> None:
        self._check()
        self._adapters.setdefault(pool, {})[name] = path

    async def drop_adapter(self, pool: str, name: str) -> None:
        self._check()
        self._adapters.get(pool, {}).pop(name, None)
