"""The queue's one way to talk to Redis: how a client is made, and what a Redis error becomes.

- ``connect``: for ``redis://`` / ``rediss://`` a client whose pooled connections are checked before use once idle for
  ``health_check_s`` (a PING, so a connection Redis dropped while restarting is replaced, not
  failed on), and whose commands are retried once on a fresh connection after a connection error,
  with a jittered backoff (so a fleet does not reconnect in lockstep). A retried write may have
  been applied the first time; every write of the queue is safe to repeat (see streams.py and
  batches.py: submissions and attempt records are idempotent scripts, events are dropped by index
  by their reader). A ``rediss://`` url speaks TLS, with the CA and client certificate of the settings.
  ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``: TLS) is a Redis Cluster: the
  nodes listed are where the client learns the cluster's map; it follows MOVED and ASK and, after a
  connection error (a master killed, a replica promoted), learns the map again and retries.
  Every multi-key command and script of the queue names keys of one hash tag (keys.py), so one
  slot; a pipeline is split per node by the client. A cluster pipeline cannot hold scripts:
  ``call_scripts`` runs a set of them in one round trip where Redis allows it.
- ``unreachable``: Redis errors become ``QueueUnavailable`` here; callers see nothing of redis-py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from llamamesh.errors import QueueUnavailable
from llamamesh.settings import RedisSettings

UNREACHABLE = "the queue is unreachable"


@contextlib.contextmanager
def unreachable(refused: str = "") -> Iterator[None]:
    """Raise any Redis error inside as ``QueueUnavailable("the queue is unreachable")``; with
    ``refused`` (what failed, e.g. "cannot read the work stream"), an error reply of the server is
    raised as that, with the reply. Server replies the caller expects (NOGROUP, BUSYGROUP) it
    catches inside, re-raising the others."""
    try:
        yield
    except ResponseError as exc:
        raise QueueUnavailable(f"{refused}: {exc}" if refused else UNREACHABLE) from exc
    except RedisError as exc:
        raise QueueUnavailable(UNREACHABLE) from exc


def tls_options(settings: RedisSettings) -> dict[str, Any]:
    """redis-py's TLS arguments for a ``rediss://`` url: the CA to verify the server with (else the
    system's) and this client's certificate and key (mutual TLS). Empty for any other url; a TLS
    file set for one raises ValueError (it would silently go unused)."""
    files = {"ssl_ca_certs": settings.tls_ca, "ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if not settings.url.startswith(("rediss://", "rediss+")):
        if any(files.values()):
            raise ValueError("LLAMAMESH_REDIS_TLS_* are set but LLAMAMESH_REDIS_URL is not rediss://")
        return {}
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("LLAMAMESH_REDIS_TLS_CERT and LLAMAMESH_REDIS_TLS_KEY must be set together")
    return {k: v for k, v in files.items() if v}


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def connect(settings: RedisSettings) -> aioredis.Redis:
    """A client for ``settings.url`` (see the module docstring for the schemes); connects lazily."""
    if not settings.url:
        raise ValueError("RedisSettings.url is empty: start the embedded server first")
    if urlsplit(settings.url).scheme in CLUSTER_SCHEMES:
        return _cluster(settings)
    return aioredis.Redis.from_url(
        settings.url,
        **tls_options(settings),
        # Blocking reads hold a connection each; the socket timeout must outlast them.
        socket_timeout=settings.block_ms / 1000 + 10,
        socket_connect_timeout=5,
        health_check_interval=settings.health_check_s,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=settings.retries),
        retry_on_error=[RedisConnectionError],
    )


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """The (host, port) of each node a ``redis+cluster://`` url lists, and its credentials
    (``username``/``password``, when given). Raises ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"LLAMAMESH_REDIS_URL: not a cluster url: {url!r}")
    auth, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"LLAMAMESH_REDIS_URL: expected {parts.scheme}://host:port[,host:port...], got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("LLAMAMESH_REDIS_URL: a Redis Cluster has only database 0")
    creds: dict[str, str] = {}
    if auth:
        user, colon, password = auth.partition(":")
        creds = {"username": unquote(user), "password": unquote(password)} if colon else {"password": unquote(user)}
        creds = {k: v for k, v in creds.items() if v}
    return nodes, creds


def _cluster(settings: RedisSettings) -> aioredis.Redis:
    nodes, creds = cluster_nodes(settings.url)
    tls: dict[str, Any] = tls_options(settings)
    options: dict[str, Any] = {**creds, **({"ssl": True, **tls} if settings.url.startswith("rediss+") else {})}
    # One type for the callers: a cluster client offers the same commands (redis-py types them apart).
    return _Cluster(  # type: ignore[return-value]
        startup_nodes=[ClusterNode(host, port) for host, port in nodes],
        **options,
        socket_timeout=settings.block_ms / 1000 + 10,
        socket_connect_timeout=5,
        health_check_interval=settings.health_check_s,
        # Blocking reads (a gateway's event lanes, a worker's lease) hold one connection each.
        max_connections=1024,
        # A master's failover takes the cluster's node timeout and then some: keep learning the new
        # map for a while (each attempt re-reads it) before the caller sees the queue unreachable.
        retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), retries=max(settings.retries, 6)),
    )


# What redis-py's cluster client raises, besides RedisError, from a connection a failover or a map
# refresh closed under a command in flight (a closed transport, a writer that is None, a socket).
_CLIENT_FAULTS = (RuntimeError, AttributeError, OSError)


def _fault(exc: BaseException) -> RedisConnectionError:
    return RedisConnectionError(f"the cluster client lost its connection mid-command: {exc!r}")


class _Cluster(RedisCluster):
    """redis-py's cluster client, with two of its faults mended at the seam:

    - it learns the cluster's map before its first command runs. Left lazy, the commands of a burst
      at start (a gateway's event lanes, each a blocking read on its own node) race the map being
      learnt: connections in use get recycled under them, and a few lanes fail their first read;
    - a connection closed under a command in flight (a master killed, the map refreshed) raises
      RuntimeError or AttributeError from inside the client: those become the ConnectionError they
      are, so that the queue's callers retry as for any outage instead of dying of it."""

    _ready: asyncio.Lock | None = None

    async def _learn_map(self) -> None:
        if self._ready is None:
            self._ready = asyncio.Lock()
        async with self._ready:
            if self._initialize:
                await self.initialize()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self._initialize:
                await self._learn_map()
            return await super().execute_command(*args, **kwargs)
        except RedisError:
            raise
        except _CLIENT_FAULTS as exc:
            raise _fault(exc) from exc

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("shard_hint is not supported on a cluster")
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]  # as redis-py makes its own


class _ClusterPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client: Any = self.cluster_client
        try:
            if client._initialize:
                await client._learn_map()
            return await super().execute(raise_on_error, allow_redirections)
        except RedisError:
            raise
        except _CLIENT_FAULTS as exc:
            raise _fault(exc) from exc


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


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
