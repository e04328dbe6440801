"""The queue's one way to talk to Redis: how a client is made (``connect``), what a Redis error becomes
(``unreachable``: callers see nothing of redis-py), and how a set of scripts is run
(``call_scripts``). Writes that wait for replicas are replicas.py's; what a failover can lose and
what WAIT guarantees: docs/guarantees.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError, OutOfMemoryError, RedisError, ResponseError

from llamamesh.errors import QueueOutOfMemory, QueueRefused, QueueUnavailable
from llamamesh.queue.cluster import RESHARD_WAIT_S, cluster_client, is_cluster
from llamamesh.queue.connection import hiredis_packed, options, tls_options
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.sentinel import PRIMARY_RECHECK_S, SENTINEL_TIMEOUT_S, sentinel_client
from llamamesh.settings import RedisSettings
from llamamesh.settings.redis import CLUSTER_SCHEMES, cluster_nodes

# Also importable from here, the queue's one door to Redis (each is its own module's).
__all__ = [
    "CLUSTER_SCHEMES",
    "OUT_OF_MEMORY",
    "OUT_OF_MEMORY_RETRY_S",
    "PRIMARY_RECHECK_S",
    "RESHARD_WAIT_S",
    "SENTINEL_TIMEOUT_S",
    "UNREACHABLE",
    "Replicas",
    "call_scripts",
    "cluster_nodes",
    "connect",
    "hiredis_packed",
    "is_cluster",
    "raised",
    "tls_options",
    "unreachable",
]

UNREACHABLE = "the queue is unreachable"
OUT_OF_MEMORY = (
    "Redis is full: it refuses writes at its maxmemory (with the noeviction policy a queue needs); "
    "nothing of this call was kept; retry later"
)
# Seconds a caller refused for a full Redis is told to wait (RetryInfo).
OUT_OF_MEMORY_RETRY_S = 5.0


# What Redis (or its TLS) says when it refuses this client for good: the settings, not the moment, are at fault.
REFUSALS = (
    "NOAUTH",
    "WRONGPASS",
    "NOPERM",
    "DB index is out of range",
    "unknown command 'HELLO'",
    "unknown command `HELLO`",
    "CERTIFICATE_VERIFY_FAILED",
    "WRONG_VERSION_NUMBER",
)


def refusal(exc: BaseException) -> str:
    """Why Redis refused this client, when ``exc`` says it answered and refused it (a password, an ACL
    permission, the database index, the protocol, TLS's certificate), which no retry mends; else ""."""
    if isinstance(exc, AuthenticationError | NoPermissionError):
        return str(exc)
    text = str(exc)
    return text if isinstance(exc, RedisError) and any(r in text for r in REFUSALS) else ""


def raised(exc: RedisError, refused: str = "") -> QueueUnavailable:
    """The domain error for a Redis error: QueueOutOfMemory for a full Redis's refusal; QueueRefused when
    it refuses this client (``refusal``); with ``refused`` (what failed), another error reply as that;
    anything else "the queue is unreachable"."""
    if isinstance(exc, OutOfMemoryError):
        return QueueOutOfMemory(OUT_OF_MEMORY, retry_after_s=OUT_OF_MEMORY_RETRY_S)
    if why := refusal(exc):
        return QueueRefused(UNREACHABLE, reason=f"Redis refuses this client: {why} (LLAMAMESH_REDIS_URL)")
    if isinstance(exc, ResponseError) and refused:
        return QueueUnavailable(f"{refused}: {exc}")
    return QueueUnavailable(UNREACHABLE)


@contextlib.contextmanager
def unreachable(refused: str = "") -> Iterator[None]:
    """Raise any Redis error inside as its domain error (``raised``): QueueOutOfMemory when Redis is
    full, else ``QueueUnavailable("the queue is unreachable")``; with ``refused`` (what failed, e.g.
    "cannot read the work stream"), an error reply of the server is raised as that, with the reply.
    Server replies the caller expects (NOGROUP, BUSYGROUP) it catches inside, re-raising the others."""
    try:
        yield
    except RedisError as exc:
        raise raised(exc, refused) from exc


def connect(settings: RedisSettings) -> aioredis.Redis:
    """A client for ``settings.url``, by its scheme (``redis://`` one server; ``rediss://``: TLS, see
    ``tls_options``; ``redis+sentinel://``: the Sentinels' primary, see sentinel.py;
    ``redis+cluster://``: a cluster, see cluster.py); connects lazily. Raises ValueError for a url it
    cannot use. Its connections are checked before use once idle, and a command is retried once on a
    fresh connection after a connection error (connection.py): every write of the queue is safe to
    repeat (its scripts are idempotent; events are dropped by index by their reader)."""
    if not settings.url:
        raise ValueError("RedisSettings.url is empty: start the embedded server first")
    if settings.sentinel() is not None:
        return sentinel_client(settings)
    if urlsplit(settings.url).scheme in CLUSTER_SCHEMES:
        return cluster_client(settings)
    pool = aioredis.BlockingConnectionPool.from_url(settings.url, **tls_options(settings), **options(settings))
    pool.connection_class = hiredis_packed(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


async def call_scripts(client: aioredis.Redis, calls: Sequence[tuple[Any, Sequence[Any], Sequence[Any]]]) -> list[Any]:
    """Run registered scripts, each (script, keys, args), and return their replies in order: one
    pipeline, or on a cluster (whose pipelines refuse scripts) all at once, each on its own node."""
    if not calls:
        return []
    if is_cluster(client):
        return list(await asyncio.gather(*(script(keys=list(k), args=list(a)) for script, k, a in calls)))
    async with client.pipeline(transaction=False) as pipe:
        for script, k, a in calls:
            await script(keys=list(k), args=list(a), client=pipe)  # queued: the replies come below
        return list(await pipe.execute())


def evicting(info: Any) -> str:
    """The policy ``INFO memory`` names when Redis would evict keys at its maxmemory ("allkeys-lru", ...), or ""
    when it evicts nothing (``noeviction``, or no maxmemory); a cluster's INFO (one per node) by its first node that
    would."""
    if isinstance(info, dict) and "maxmemory_policy" not in info:
        return next((p for p in (evicting(v) for v in info.values() if isinstance(v, dict)) if p), "")
    policy = str(info.get("maxmemory_policy", "noeviction"))
    return policy if policy != "noeviction" and int(info.get("maxmemory", 0) or 0) > 0 else ""
