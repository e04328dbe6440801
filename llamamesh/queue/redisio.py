"""The queue's one way to talk to Redis: how a client is made, what a Redis error becomes, and which
writes wait for replicas.

- ``connect``: a client for ``LLAMAMESH_REDIS_URL``, by its scheme: ``redis://`` / ``rediss://``
  (TLS, with the CA and client certificate of the settings) one server; ``redis+sentinel://`` /
  ``rediss+sentinel://`` the primary the Sentinels name (``_sentinel``). Either way its pooled
  connections are checked before use once idle for ``health_check_s`` (a PING, so a connection
  Redis dropped while restarting is replaced, not failed on), and its commands are retried once on
  a fresh connection after a connection error, with a jittered backoff (so a fleet does not
  reconnect in lockstep). A retried write may have been applied the first time; every write of the
  queue is safe to repeat (see streams.py and batches.py: submissions and attempt records are
  idempotent scripts, events are dropped by index by their reader).
- Sentinel: each new connection asks the Sentinels (in the url's order, the last one that answered
  first) for the primary; so does the pool at most every ``PRIMARY_RECHECK_S`` while commands flow,
  dropping its connections to a primary that is no longer the one (a failover while the old one
  stays up: SENTINEL FAILOVER, a partition) instead of writing on to it until Sentinel demotes it
  (about 10 s later). A connection that finds its server demoted (READONLY) is dropped and the
  command retried on the new primary. While no primary is reachable (a failover takes a few
  seconds) commands fail as a restart makes them fail: QueueUnavailable, which every loop of
  gateways and workers waits through (open streams up to ``outage_grace_s``).
- ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``: TLS) is a Redis Cluster
  (``_cluster``): the nodes listed are where the client learns the cluster's map; it follows MOVED
  and ASK (``_AskingNode`` sends the ASKING on the command's own connection; a command still
  redirected after the client's tries, a slot in migration, is tried again for ``RESHARD_WAIT_S``)
  and, after a connection error (a master killed, a replica promoted), learns the map again and
  retries. Every multi-key command and script of the queue names keys of one hash tag
  (keys.py), so one slot; a pipeline is split per node by the client. A cluster pipeline cannot
  hold scripts: ``call_scripts`` runs a set of them in one round trip where Redis allows it. WAIT
  (below) is for one primary and its replicas: refused with a cluster url.
- Every connection (single server, Sentinel's primary, each cluster node) packs its commands with
  hiredis's C packer (``hiredis_packed``), not redis-py's asyncio one, which is Python.
- ``unreachable``: Redis errors become ``QueueUnavailable`` here; callers see nothing of redis-py.
- ``Replicas``: ``WAIT <wait_replicas> <wait_timeout_ms>`` on the same connection right after a
  write (in the write's pipeline).

What a failover can lose, and what WAIT changes. Replication is asynchronous: a replica has a
prefix of what the primary applied, so the one promoted may lack the primary's last writes. A
prefix never holds a later write without the earlier ones, hence:

- A submission (the job, its marker, and the attempt record written before it) lost is a stream
  that waits for a job nobody will run. With ``wait_replicas`` the submission is on that many
  replicas before the gateway answers (fewer within the timeout, or a connection lost meanwhile:
  the call fails UNAVAILABLE, which a client retries; the write stays on the primary and a retry
  finds it: the scripts are idempotent, and one that finds its write done writes again, so its own
  WAIT covers the first). Likewise a Cancel (``call_off``), a batch's creation (its record and every
  item: the batch id it answers with names a batch that survives) and a batch's cancel.
- A batch item's result and its ack: the ack is written after the result, so it never survives
  without it. A lost result (and its ack) leaves the item pending or unleased on the new primary:
  it runs again and its result is recorded once there (``_RECORD`` writes only the first).
  Execution is at least once; the batch completes with every item exactly once.
- Events: a lost event the gateway had relayed is followed by the worker's next ones with the next
  indexes (the worker does not know), so the caller's stream goes on; one it had not relayed is a
  gap, which the relay resumes from what the caller has (services/relay.py); a lost terminal event
  (and its ack) leaves the job pending, taken over after ``claim_idle_s`` and resumed the same way.
  A lost lease makes a job run twice, the repeats dropped by index. So events and leases do not
  WAIT (a round trip to a replica per engine step).

How much WAIT guarantees depends on the failover and on the replicas:

- A crash of the primary (kill -9, a lost host): Sentinel promotes the replica with the most of
  the stream (as it last saw them). With one replica, or ``wait_replicas`` = every replica, each
  acknowledged write is on the one promoted.
- SENTINEL FAILOVER, or a partition that leaves the old primary reachable: the old primary stays a
  primary (about 10 s, until Sentinel demotes it and drops what it holds), and the Sentinels name
  the new one only about a second after promoting it; meanwhile clients write to the old one. With
  one replica, the promoted one was its only replica: WAIT refuses those writes. With two or more,
  a replica not moved yet acknowledges them, and they are lost (measured here: about a second of
  acknowledged submissions). ``wait_replicas`` = every replica closes that too.
- The price: an acknowledged write needs ``wait_replicas`` replicas up. After a failover there is
  one fewer: with one replica (or WAIT on every replica), submissions, Cancels and batch creations
  fail UNAVAILABLE until the old primary is back as a replica; with more replicas than
  ``wait_replicas`` they go on.

Other limits: WAIT does not keep others from reading a write before it is replicated (a results
reader may see an item's result that is then lost, and later its second run's); quotas, heartbeats
and the sweep's bookkeeping do not WAIT (after a failover a tenant may get a little more of its
budget, a worker may look lost for a heartbeat, and its streams are resumed); with
``wait_replicas`` 0 a submission in the last moments before a failover may be lost, its stream
waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
import redis.asyncio as aioredis
import redis.asyncio.cluster as _redis_cluster
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ClusterError, DataError, OutOfMemoryError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from llamamesh.errors import QueueOutOfMemory, QueueUnavailable
from llamamesh.settings import RedisSettings

UNREACHABLE = "the queue is unreachable"
# A Sentinel client's pool asks the Sentinels for the primary at most this often while it is used.
PRIMARY_RECHECK_S = 1.0
# How long one question to one Sentinel may take before the next one is asked.
SENTINEL_TIMEOUT_S = 1.0


OUT_OF_MEMORY = (
    "Redis is full: it refuses writes at its maxmemory (with the noeviction policy a queue needs); "
    "nothing of this call was kept; retry later"
)
# Seconds a caller refused for a full Redis is told to wait (RetryInfo).
OUT_OF_MEMORY_RETRY_S = 5.0


def raised(exc: RedisError, refused: str = "") -> QueueUnavailable:
    """The domain error for a Redis error: QueueOutOfMemory for a full Redis's refusal; with
    ``refused`` (what failed), another error reply as that; anything else "the queue is unreachable"."""
    if isinstance(exc, OutOfMemoryError):
        return QueueOutOfMemory(OUT_OF_MEMORY, retry_after_s=OUT_OF_MEMORY_RETRY_S)
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


def tls_options(settings: RedisSettings) -> dict[str, Any]:
    """redis-py's TLS arguments for a ``rediss://`` (or ``rediss+sentinel://``: to the data nodes)
    url: the CA to verify the server with (else the system's) and this client's certificate and key
    (mutual TLS). Empty for any other url; a TLS file set for one raises ValueError (it would
    silently go unused)."""
    files = {"ssl_ca_certs": settings.tls_ca, "ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if not settings.url.startswith(("rediss://", "rediss+sentinel://", "rediss+cluster://")):
        if any(files.values()):
            raise ValueError("LLAMAMESH_REDIS_TLS_* are set but LLAMAMESH_REDIS_URL is not rediss:// "
                             "(or rediss+sentinel://, rediss+cluster://)")  # fmt: skip
        return {}
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("LLAMAMESH_REDIS_TLS_CERT and LLAMAMESH_REDIS_TLS_KEY must be set together")
    return {k: v for k, v in files.items() if v}


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def connect(settings: RedisSettings) -> aioredis.Redis:
    """A client for ``settings.url``, by its scheme (``rediss://``: TLS, see ``tls_options``;
    ``redis+sentinel://``: through Sentinel, see ``_sentinel``; ``redis+cluster://``: a cluster, see
    ``_cluster``); connects lazily. Raises ValueError for a url it cannot use."""
    if not settings.url:
        raise ValueError("RedisSettings.url is empty: start the embedded server first")
    if settings.sentinel() is not None:
        return _sentinel(settings)
    if urlsplit(settings.url).scheme in CLUSTER_SCHEMES:
        return _cluster(settings)
    pool = aioredis.BlockingConnectionPool.from_url(settings.url, **tls_options(settings), **_options(settings))
    pool.connection_class = hiredis_packed(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


class _HiredisPacking:
    """A connection mixin: commands packed by hiredis's ``pack_command`` (C), not by redis-py's
    asyncio ``AbstractConnection.pack_command`` (Python; 8.1 has no hook for a packer there, its
    sync client has one). Measured on the 2-core box: 12 µs → 1.6 µs for a typical EVALSHA; the
    worker's per-token XADDs spent about 12 % of its time there. The same bytes as redis-py's for
    every argument redis-py accepts (str as UTF-8, bytes, int, float as repr); what it refuses
    (None, bool, other types) is refused as redis-py does, with DataError. Connections here use
    redis-py's default encoding (UTF-8, strict), which is hiredis's."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]  # "CONFIG GET" as one argument: its words are arguments (as redis-py)
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a bytearray or memoryview (which redis-py takes, hiredis not), or bad input
            pass
        args = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in args)
        try:
            return [hiredis.pack_command(args)]
        except TypeError as exc:
            kinds = sorted({type(a).__name__ for a in args if not isinstance(a, (str, bytes, int, float))})
            raise DataError(f"Invalid input of type: {', '.join(kinds) or exc}. "
                            "Convert to a bytes, string, int or float first.") from exc  # fmt: skip


_PACKED: dict[type, type] = {}


def hiredis_packed(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """``cls`` with its commands packed by hiredis (``_HiredisPacking``): a subclass of the same
    name, made once per class (``cls`` itself if it already is one)."""
    if issubclass(cls, _HiredisPacking) or not issubclass(cls, AbstractConnection):
        return cls
    if cls not in _PACKED:
        _PACKED[cls] = type(cls.__name__, (_HiredisPacking, cls), {"__module__": cls.__module__})
    return _PACKED[cls]


def _options(settings: RedisSettings) -> dict[str, Any]:
    """What every client's connections share: timeouts, the health check, the retry, and the
    bound on connections (a blocking pool: a command that finds every connection busy waits for
    one, as long as a command may take, instead of failing at once, as redis-py's default pool
    does past 100: a burst of 256 new calls on one gateway process failed UNAVAILABLE)."""
    if settings.max_connections < 8:
        raise ValueError(f"LLAMAMESH_REDIS_MAX_CONNECTIONS must be 8 or more, not {settings.max_connections}")
    # Blocking reads hold a connection each: the socket timeout must outlast them, and a command
    # waiting for a free connection waits as long as one command may take.
    longest_s = settings.block_ms / 1000 + 10
    return {
        "max_connections": settings.max_connections,
        "timeout": longest_s,
        "socket_timeout": longest_s,
        "socket_connect_timeout": 5,
        "health_check_interval": settings.health_check_s,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=settings.retries),
        "retry_on_error": [RedisConnectionError],
    }


def _sentinel(settings: RedisSettings) -> aioredis.Redis:
    """A client of the primary the Sentinels of a ``redis+sentinel://`` url name for its service,
    with the url's db and credentials (for the data nodes; the Sentinels are asked without) and,
    for ``rediss+sentinel://``, TLS to the data nodes. Closing it closes its Sentinel clients."""
    url = settings.sentinel()
    assert url is not None
    tls = {"ssl": True, **tls_options(settings)} if url.tls else tls_options(settings)
    # A Sentinel that does not answer is skipped for the next one, at once.
    asking = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S,
              "retry": Retry(NoBackoff(), 0)}  # fmt: skip
    sentinels = Sentinel(list(url.sentinels), sentinel_kwargs=asking)
    client: aioredis.Redis = sentinels.master_for(
        url.service, redis_class=_SentinelRedis, connection_pool_class=_SentinelPool,
        db=url.db, username=url.username, password=url.password, **tls, **_options(settings),
    )  # fmt: skip
    client.connection_pool.connection_class = hiredis_packed(client.connection_pool.connection_class)
    return client


class _SentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis-py's pool of the Sentinels' primary, which asks them again at most every
    ``PRIMARY_RECHECK_S`` when a connection is taken (idle connections to an old primary are then
    dropped), and drops a connection given back to an old primary; bounded and waiting for a free
    connection as the single server's pool (``_options``)."""

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
        startup_nodes=[_AskingNode(host, port) for host, port in nodes],
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


# How long a cluster command keeps being redirected (a slot on its way between masters: TRYAGAIN
# while a multi-key command's keys are split, ASK/MOVED) before its caller sees the queue unreachable.
RESHARD_WAIT_S = 10.0
# The node an ASK sent the current task to: its ASKING goes out with the next command (_AskingNode).
_ASKED: contextvars.ContextVar[ClusterNode | None] = contextvars.ContextVar("llamamesh_asked", default=None)


class _AskingNode(ClusterNode):
    """redis-py's cluster node (8.1), sending ASKING on the connection of the command it allows,
    and closing idle connections without closing them under a command (disconnect_free_connections).

    After an ASK its client sends ASKING to the new node as a command of its own, on the first free
    pooled connection, and the redirected command on the next free one. With two connections or
    more to that node, the command arrives without ASKING; the node answers MOVED back to the old
    master, which answers ASK again, until the client's tries are spent ("TTL exhausted"): every
    command on a key already moved fails for as long as its slot migrates. Here ASKING is held back
    and sent with the command, on one connection, as Redis requires. Its connections pack commands
    with hiredis (``hiredis_packed``)."""

    def __init__(self, *args: Any, connection_class: type[Connection] = Connection, **kwargs: Any) -> None:
        super().__init__(*args, connection_class=hiredis_packed(connection_class), **kwargs)  # type: ignore[arg-type]

    async def execute_command(self, *args: Any, asking: bool = False, **kwargs: Any) -> Any:
        if args == ("ASKING",):
            _ASKED.set(self)  # the client awaits this node's next command right after, in this task
            return True
        if _ASKED.get() is not self:
            return await super().execute_command(*args, asking=asking, **kwargs)
        _ASKED.set(None)
        connection = self.acquire_connection()
        try:
            await self.disconnect_if_needed(connection)
            await connection.send_packed_command(connection.pack_commands([("ASKING",), args]))
            refused: ResponseError | None = None
            try:
                await self.parse_response(connection, "ASKING")
            except ResponseError as exc:  # read the command's reply anyway: the connection stays in step
                refused = exc
            reply = await self.parse_response(connection, args[0], **kwargs)
            if refused is not None:
                raise refused
            return reply
        finally:
            try:
                await self.disconnect_if_needed(connection)
            finally:
                self.release(connection)

    async def disconnect_free_connections(self) -> None:
        """Close the idle connections (redis-py calls this on a node whose command lost its
        connection, and on a node dropped from the map), taking them out of the free list while
        they close. redis-py's own leaves them there: a command started meanwhile takes one, and
        the close lands under it ("Connection closed by server", "Connection lost" while writing),
        so one lost connection fails other commands on the node, until they all give up."""
        idle = tuple(self._free)
        self._free.clear()
        try:
            await asyncio.gather(*(connection.disconnect() for connection in idle), return_exceptions=True)
        finally:
            self._free.extend(idle)


def _stream_keys(command: Any, args: Sequence[Any]) -> Sequence[Any] | None:
    """The stream keys of an XREAD or XREADGROUP (``args`` after the command's name), None for
    another command: the first half of what follows STREAMS. XREADGROUP's group and consumer come
    first, and the options between take numbers, so the first STREAMS from there is the keyword."""
    name = _word(command)
    if name not in ("XREAD", "XREADGROUP"):
        return None
    start = 3 if name == "XREADGROUP" else 0
    at = next((i for i in range(start, len(args)) if _word(args[i]) == "STREAMS"), None)
    rest = args[at + 1 :] if at is not None else ()
    if not rest or len(rest) % 2:
        raise RedisClusterException(f"Invalid args in command: {command, *args}")
    return rest[: len(rest) // 2]


def _word(arg: Any) -> str:
    return (arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)).upper()


# The client makes the nodes it learns from the cluster's map by this module-level name.
_redis_cluster.ClusterNode = _AskingNode  # type: ignore[misc]


class _Cluster(RedisCluster):
    """redis-py's cluster client, with five of its faults mended at the seam (two more in
    _AskingNode: ASKING on the wrong connection, idle connections closed under a command):

    - it learns the cluster's map before its first command runs. Left lazy, the commands of a burst
      at start (a gateway's event lanes, each a blocking read on its own node) race the map being
      learnt: connections in use get recycled under them, and a few lanes fail their first read;
    - it learns the map again (after a lost connection, every few MOVED) inside whichever command
      comes next, and when that learning fails it closes every connection of every node. A caller
      cancelled meanwhile (its stream's caller gone, a timeout) counted as failing: every command
      in flight died "Connection closed by server". The learning runs as a task of its own here,
      once for all the commands that wait on it, and a cancelled caller stops waiting, not learning;
    - it asks a node (COMMAND GETKEYS, one more round trip, never retried) for the keys of XREAD and
      XREADGROUP, the queue's most frequent commands: their keys are read from the command here;
    - a connection closed under a command in flight (a master killed, the map refreshed) raises
      RuntimeError or AttributeError from inside the client: those become the ConnectionError they
      are, so that the queue's callers retry as for any outage instead of dying of it;
    - it gives a command up after 16 redirections (about 0.4 s of TRYAGAIN while a slot's keys are
      split between two masters): such a command never ran, so it is tried again for
      RESHARD_WAIT_S."""

    _learning: asyncio.Future[Any] | None = None

    async def initialize(self, *args: Any, **kwargs: Any) -> _Cluster:
        if not self._initialize:
            return self
        learning = self._learning
        if learning is None or learning.done():
            learning = self._learning = asyncio.ensure_future(super().initialize(*args, **kwargs))
            # Its error reaches every waiter; read here too, so that none waiting leaves no warning.
            learning.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.shield(learning)
        return self

    async def _determine_slot(self, command: str, *args: Any) -> int:
        keys = _stream_keys(command, args)
        if keys is None:
            return await super()._determine_slot(command, *args)
        slots = {self.keyslot(key) for key in keys}
        if len(slots) != 1:
            raise RedisClusterException(f"{command} - all keys must map to the same key slot")
        return slots.pop()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + RESHARD_WAIT_S
        pause = 0.05
        while True:
            try:
                await self.initialize()
                return await super().execute_command(*args, **kwargs)
            except ClusterError as exc:
                # Only redirections (MOVED, ASK, TRYAGAIN: never run) spend the client's tries: a
                # slot in migration. Try again until it has moved, within RESHARD_WAIT_S.
                if str(exc) != "TTL exhausted." or time.monotonic() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.5)
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
            await client.initialize()
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


@dataclass(frozen=True)
class Replicas:
    """How many replicas must acknowledge a write a client is told about, before it is told
    (``RedisSettings.wait_replicas``; 0: none, nothing waits), and for how long at most."""

    count: int = 0
    timeout_ms: int = 1000

    @classmethod
    def of(cls, settings: RedisSettings) -> Replicas:
        return cls(settings.wait_replicas, settings.wait_timeout_ms)

    def wait(self, pipe: Any) -> None:
        """Queue ``WAIT`` as ``pipe``'s last command (nothing when ``count`` is 0): it runs on the
        pipeline's connection right after the writes before it, and covers every write Redis
        applied before them (replication keeps their order)."""
        if self.count:
            pipe.wait(self.count, self.timeout_ms)

    def check(self, replies: Sequence[Any], what: str) -> list[Any]:
        """The pipeline's ``replies`` less WAIT's; raises QueueUnavailable when fewer than ``count``
        replicas acknowledged ``what`` (it stays on the primary)."""
        if not self.count:
            return list(replies)
        *rest, acked = replies
        if int(acked) < self.count:
            raise QueueUnavailable(
                f"{what} reached {int(acked)} of the {self.count} Redis replicas it needs within {self.timeout_ms} ms"
            )
        return rest

    async def script(self, client: aioredis.Redis, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """Run a registered ``script``: ``[its reply]``, or with ``count``, ``[its reply, WAIT's]``
        from one pipeline (the same connection); ``check`` them once the reply is judged."""
        if not self.count:
            return [await script(keys=list(keys), args=list(args))]
        async with client.pipeline(transaction=False) as pipe:
            await script(keys=list(keys), args=list(args), client=pipe)
            self.wait(pipe)
            return list(await pipe.execute())
