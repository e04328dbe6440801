"""A client of a Redis Cluster (``redis+cluster://host:port[,host:port...]``; ``rediss+cluster://``:
TLS): redis-py's, with its faults mended at the seam (``cluster_client``). Every multi-key command
and script of the queue names keys of one hash tag (keys.py), so one slot; a pipeline is split per
node by the client, and cannot hold scripts (``redisio.call_scripts``).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
import redis.asyncio.cluster as _redis_cluster
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from llamamesh.queue.connection import hiredis_packed, tls_options
from llamamesh.settings import RedisSettings
from llamamesh.settings.redis import cluster_nodes


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def cluster_client(settings: RedisSettings) -> aioredis.Redis:
    """A client of the cluster the url's nodes belong to; connects lazily. Raises ValueError for a
    url it cannot use. The nodes listed are where the client learns the cluster's map; it follows
    MOVED and ASK (``_AskingNode`` sends the ASKING on the command's own connection; a command still
    redirected after the client's tries, a slot in migration, is tried again for ``RESHARD_WAIT_S``)
    and, after a connection error (a master killed, a replica promoted), learns the map again and
    retries."""
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
        # A MOVED patches its slot's owner in the map. redis-py's default, re-learning the whole map
        # every 5th MOVED, does it by closing every connection of every node, under the commands in
        # flight: a resharding (every command on a moved slot answered MOVED once) failed them.
        reinitialize_steps=0,
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
    and sent with the command, on one connection, as Redis requires. A connection closed under a
    command (its writer gone: AttributeError, RuntimeError) fails it with ConnectionError, which the
    client retries on a fresh connection once it has learnt the map again; redis-py let those
    through unretried. Its connections pack commands with hiredis (``hiredis_packed``)."""

    def __init__(self, *args: Any, connection_class: type[Connection] = Connection, **kwargs: Any) -> None:
        super().__init__(*args, connection_class=hiredis_packed(connection_class), **kwargs)  # type: ignore[arg-type]

    async def execute_command(self, *args: Any, asking: bool = False, **kwargs: Any) -> Any:
        try:
            return await self._execute(*args, asking=asking, **kwargs)
        except _CLIENT_FAULTS as exc:  # a lost connection, to the client's retries as to its callers
            raise _fault(exc) from exc

    async def execute_pipeline(self, commands: list[Any]) -> bool:
        try:
            failed = await super().execute_pipeline(commands)
        except _CLIENT_FAULTS as exc:
            raise _fault(exc) from exc
        for cmd in commands:  # a reply read from a connection closed under it
            if isinstance(cmd.result, _CLIENT_FAULTS):
                cmd.result = _fault(cmd.result)
        return failed

    async def _execute(self, *args: Any, asking: bool, **kwargs: Any) -> Any:
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


def stream_keys(command: Any, args: Sequence[Any]) -> Sequence[Any] | None:
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
    """redis-py's cluster client, with five of its faults mended at the seam (three more in
    _AskingNode: ASKING on the wrong connection, idle connections closed under a command, a command
    whose connection was closed under it not retried; and one by its settings: every 5th MOVED
    closed every connection of every node, ``reinitialize_steps=0`` in cluster_client):

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
      are (in the node, where the client's own retries see them; here for what escapes them), so
      that the queue's callers retry as for any outage instead of dying of it;
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
        keys = stream_keys(command, args)
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
