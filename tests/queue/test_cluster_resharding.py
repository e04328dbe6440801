"""The cluster client while a slot moves between masters (a live resharding, as ``redis-cli
--cluster reshard`` does it), on a real cluster of six redis-server processes.

While a slot migrates, a key already moved answers ``ASK`` from the old master, and the client
must send ``ASKING`` on the connection that then carries the command; a command whose keys are
split between the two answers ``TRYAGAIN`` until the slot has moved (llamamesh/queue/redisio.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.redisio import connect
from llamamesh.settings import RedisSettings
from tests.redisproc import RedisClusterProcs
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

# A script over two keys of one slot: it can only run where both are.
BOTH = "return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    with RedisClusterProcs(tmp_path_factory.mktemp("resharding")) as c:
        yield c


@pytest.fixture
async def client(cluster: RedisClusterProcs) -> AsyncIterator[aioredis.Redis]:
    c = connect(RedisSettings(url=cluster.url))
    try:
        yield c
    finally:
        await c.aclose()


def a_tag_on(cluster: RedisClusterProcs, port: int, not_: str = "") -> str:
    """A hash tag whose slot the master on ``port`` serves."""
    return next(t for t in (f"t{i}" for i in range(1000)) if t != not_ and cluster.master_of(f"{{{t}}}").port == port)


async def test_commands_follow_ask_and_tryagain_while_a_slot_moves(
    cluster: RedisClusterProcs, client: aioredis.Redis
) -> None:
    c = client
    tag = a_tag_on(cluster, cluster.master_of("{t0}").port)
    a, b = f"{{{tag}}}:a", f"{{{tag}}}:b"
    await c.set(a, "1")
    await c.set(b, "2")
    migration = cluster.start_migration(a)
    # Several pooled connections to the target (commands at once on one of its own slots): the
    # ASKING that an ASK calls for must go on the connection of the command it allows.
    busy = a_tag_on(cluster, migration.target.port)
    await asyncio.gather(*(c.blpop([f"{{{busy}}}:q{i}"], 0.2) for i in range(8)))
    migration.move([a])

    # a moved: ASK, then ASKING + GET on the target; a new key is made on the target.
    assert await asyncio.gather(*(c.get(a) for _ in range(8))) == [b"1"] * 8
    assert await c.set(f"{{{tag}}}:new", "3")
    assert await c.get(f"{{{tag}}}:new") == b"3"
    assert await c.get(b) == b"2"  # still on the source

    # a script over a and b: TRYAGAIN while they are split, then it runs where both are.
    script = c.register_script(BOTH)
    both = asyncio.create_task(script(keys=[a, b]))
    await asyncio.sleep(1.0)  # time passing on purpose: the split lasts longer than redis-py's own 16 tries
    assert not both.done()
    await asyncio.to_thread(migration.finish)
    assert await asyncio.wait_for(both, 10) == [b"1", b"2"]

    # Moved: MOVED teaches the client the new owner.
    assert cluster.master_of(a).port == migration.target.port
    assert await asyncio.gather(c.get(a), c.get(b), c.get(f"{{{tag}}}:new")) == [b"1", b"2", b"3"]


async def test_closing_a_nodes_idle_connections_fails_no_command_on_it(
    cluster: RedisClusterProcs, client: aioredis.Redis
) -> None:
    """redis-py closes a node's idle connections when a command on it loses its connection (a
    slot moving, a master killed). A command that takes one of them meanwhile must not have it
    closed under it: one lost connection would fail every command started on the node in that
    window (seen as a Generate failing UNAVAILABLE while a slot moved)."""
    c: Any = client
    await c.set("{t0}:k", "v")
    node = c.get_node_from_key("{t0}:k")
    await asyncio.gather(*(c.blpop(["{t0}:idle"], 0.05) for _ in range(4)))  # idle pooled connections
    assert len(node._free) >= 2
    closing = asyncio.create_task(node.disconnect_free_connections())
    # Looked at every turn: the close has begun (it took the idle ones) and waits on their sockets.
    await until(lambda: not node._free, 5, "the close to take the idle connections", poll_s=0)
    # What the client does for a command on the node: one connection of the node, for one command.
    assert await asyncio.gather(*(node.execute_command("GET", "{t0}:k") for _ in range(4))) == [b"v"] * 4
    await asyncio.wait_for(closing, 5)
    assert await c.get("{t0}:k") == b"v"  # the closed ones reconnect when next taken


async def test_a_command_cancelled_while_the_map_is_relearnt_fails_no_other_command(
    cluster: RedisClusterProcs, client: aioredis.Redis
) -> None:
    """After a lost connection the next command learns the cluster's map again. redis-py closes
    every connection of every node when that learning fails, and a cancelled caller (a stream's
    caller gone, a timeout) counts as failing: the commands in flight on other connections (a
    gateway's blocking reads, a worker's lease) died "Connection closed by server"."""
    c: Any = client
    await c.set("{t0}:k", "v")
    node = c.get_node_from_key("{t0}:held")
    # In flight through the relearning, and not retried by redis-py (a node named: no tries left),
    # so that a closed connection shows.
    held = asyncio.create_task(c.execute_command("BLPOP", "{t0}:held", 1, target_nodes=node))
    await until(lambda: len(node._connections) > len(node._free), 10, "the blocking read to hold a connection")
    c._initialize = True  # as after a lost connection: the next command learns the map first
    learner = asyncio.create_task(c.get("{t0}:k"))
    # Looked at every turn, not on a clock: the learner must be cancelled while it holds the lock.
    await until(lambda: c._lock is not None and c._lock.locked(), 10, "the next command to learn the map", poll_s=0)
    learner.cancel()
    assert await asyncio.wait_for(held, 10) is None  # its timeout, not a closed connection
    assert await c.get("{t0}:k") == b"v"


async def test_stream_reads_are_routed_without_asking_a_node_for_their_keys(
    cluster: RedisClusterProcs, client: aioredis.Redis
) -> None:
    """redis-py asks a node (COMMAND GETKEYS) where XREAD's and XREADGROUP's keys are: one more round
    trip per read, and one more connection that can fail it. The client reads them itself."""
    c: Any = client
    await c.xadd("{t0}:s", {"f": "v"})
    await c.xgroup_create("{t0}:s", "g", id="0", mkstream=True)
    await c.execute_command("CONFIG RESETSTAT", target_nodes=c.get_nodes())
    assert [m for _, m in (await c.xread({"{t0}:s": "0"}, count=1, block=10))[0][1]] == [{b"f": b"v"}]
    assert [m for _, m in (await c.xreadgroup("g", "c", {"{t0}:s": ">"}, count=1))[0][1]] == [{b"f": b"v"}]
    stats = await c.info("commandstats", target_nodes=c.get_nodes())
    assert not [k for node in stats.values() for k in node if "getkeys" in k], stats


async def test_moved_replies_close_no_connection_in_flight(cluster: RedisClusterProcs, client: aioredis.Redis) -> None:
    """Once a slot has moved, each command on it with the old map answers MOVED. redis-py's default
    re-learns the whole map every 5th MOVED by closing every connection of every node, under the
    commands in flight: a resharding failed blocking reads and scripts mid-reply. A MOVED only
    patches its slot's owner here."""
    c: Any = client
    stay = a_tag_on(cluster, cluster.master_of("{t0}").port)
    tag = a_tag_on(cluster, cluster.master_of("{t0}").port, not_=stay)
    await c.set(f"{{{tag}}}:k", "v")
    node = c.get_node_from_key(f"{{{stay}}}:held")
    held = asyncio.create_task(c.execute_command("BLPOP", f"{{{stay}}}:held", 2, target_nodes=node))
    await until(lambda: len(node._connections) > len(node._free), 10, "the blocking read to hold a connection")
    await asyncio.to_thread(cluster.migrate_slot, f"{{{tag}}}")
    # The client still has the old owner: each of these is answered MOVED once (more than 5 of them).
    assert await asyncio.gather(*(c.get(f"{{{tag}}}:k") for _ in range(16))) == [b"v"] * 16
    assert await asyncio.wait_for(held, 10) is None  # its timeout, not a closed connection


def _lose_next_send(node: Any) -> list[int]:
    """The next command sent on one of ``node``'s connections fails as redis-py fails when the
    connection was closed under it (its writer gone). Returns the list of such failures."""
    lost: list[int] = []
    original = node.connection_class.send_packed_command

    async def send(self: Any, *args: Any, **kwargs: Any) -> None:
        if not lost:
            lost.append(1)
            raise AttributeError("'NoneType' object has no attribute 'writelines'")
        await original(self, *args, **kwargs)

    node.connection_class = type("Losing", (node.connection_class,), {"send_packed_command": send})
    for connection in (*node._free, *node._connections):
        connection.__class__ = node.connection_class
    return lost


@pytest.mark.parametrize("how", ["command", "pipeline"])
async def test_a_connection_closed_under_a_command_is_retried(
    cluster: RedisClusterProcs, client: aioredis.Redis, how: str
) -> None:
    """A connection closed under a command in flight (the map re-learnt, a master killed) raises
    AttributeError or RuntimeError from inside redis-py: a lost connection, retried on a fresh one
    as redis-py retries its own ConnectionError, not an error for the queue's caller."""
    c: Any = client
    await c.set("{t0}:k", "v")
    lost = _lose_next_send(c.get_node_from_key("{t0}:k"))
    if how == "command":
        assert await c.get("{t0}:k") == b"v"
    else:
        async with c.pipeline(transaction=False) as pipe:
            pipe.get("{t0}:k")
            assert await pipe.execute() == [b"v"]
    assert lost == [1]
