"""A client of the primary the Sentinels of a ``redis+sentinel://`` url name (``rediss+sentinel://``:
TLS to the data nodes), which follows a failover: each new connection asks the Sentinels (in the
url's order, the last one that answered first) for the primary, and the pool asks again while
commands flow (``_SentinelPool``). While no primary is reachable commands fail as a restart makes
them fail.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from llamamesh.queue.connection import hiredis_packed, options, tls_options
from llamamesh.settings import RedisSettings

# A Sentinel client's pool asks the Sentinels for the primary at most this often while it is used.
PRIMARY_RECHECK_S = 1.0
# How long one question to one Sentinel may take before the next one is asked.
SENTINEL_TIMEOUT_S = 1.0


def sentinel_client(settings: RedisSettings) -> aioredis.Redis:
    """A client of the primary the Sentinels of a ``redis+sentinel://`` url name for its service,
    with the url's db and credentials (for the data nodes; the Sentinels are asked without) and,
    for ``rediss+sentinel://``, TLS to the data nodes. Closing it closes its Sentinel clients."""
    url = settings.sentinel()
    assert url is not None
    tls = {"ssl": True, **tls_options(settings)} if url.tls else tls_options(settings)
    # A Sentinel that does not answer is skipped for the next one, at once.
    asking = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }
    sentinels = Sentinel(list(url.sentinels), sentinel_kwargs=asking)
    client: aioredis.Redis = sentinels.master_for(
        url.service,
        redis_class=_SentinelRedis,
        connection_pool_class=_SentinelPool,
        db=url.db,
        username=url.username,
        password=url.password,
        **tls,
        **options(settings),
    )
    client.connection_pool.connection_class = hiredis_packed(client.connection_pool.connection_class)
    return client


class _SentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis-py's pool of the Sentinels' primary, which asks them again at most every
    ``PRIMARY_RECHECK_S`` when a connection is taken (idle connections to an old primary are then
    dropped), and drops a connection given back to an old primary; bounded and waiting for a free
    connection as the single server's pool (``connection.options``). So a failover while the old
    primary stays up (SENTINEL FAILOVER, a partition) is followed at once, instead of writing on to
    the old one until Sentinel demotes it (about 10 s later). A connection that finds its server
    demoted (READONLY) is dropped and the command retried on the new primary."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)
        self._checked_at = time.monotonic()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if self.master_address is not None and now - self._checked_at >= PRIMARY_RECHECK_S:
            self._checked_at = now
            # Unanswered (no Sentinel reachable, or none names a primary: a failover is on): go on
            # with the connections there are; a new one asks the Sentinels itself and fails then.
            with contextlib.suppress(RedisError):
                await self.get_master_address()
        return await super().get_connection(*args, **kwargs)

    async def release(self, connection: Any) -> None:
        if self.master_address is not None and (connection.host, connection.port) != tuple(self.master_address):
            await connection.disconnect()  # it was busy when the primary moved: the next use reconnects
        await super().release(connection)


class _SentinelRedis(aioredis.Redis):
    """The Sentinel client's ``Redis``: closing it closes its connections to the Sentinels too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            await pool.sentinel_manager.aclose()
