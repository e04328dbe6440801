"""The LoRA adapters loaded into each pool at run time (``Keys.adapters``, a hash name -> path):
AdminService writes it, the pool's workers load what it lists at their next heartbeat.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from llamamesh.queue.keys import Keys
from llamamesh.queue.redisio import unreachable


class AdapterTable:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._r = client
        self.keys = keys

    async def adapters(self, pool: str) -> dict[str, str]:
        with unreachable():
            raw: Any = await self._r.hgetall(self.keys.adapters(pool))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def set_adapter(self, pool: str, name: str, path: str) -> None:
        with unreachable():
            await self._r.hset(self.keys.adapters(pool), name, path)

    async def drop_adapter(self, pool: str, name: str) -> None:
        with unreachable():
            await self._r.hdel(self.keys.adapters(pool), name)
