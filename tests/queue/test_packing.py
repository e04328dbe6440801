"""Commands packed by hiredis (llamamesh/queue/connection.py: ``hiredis_packed``): the same bytes as
redis-py's own asyncio packer for every argument it accepts, the same refusal for what it refuses,
on every kind of client ``connect`` makes, and real round trips on each server kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hiredis
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import DataError

from llamamesh.queue.redisio import connect, hiredis_packed
from llamamesh.settings import RedisSettings

pytestmark = pytest.mark.timeout(60)

PACKED = hiredis_packed(Connection)

arguments = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=20).map(bytearray),
    st.binary(max_size=20).map(lambda b: memoryview(b)),
    st.binary(min_size=7000, max_size=9000),  # past redis-py's buffer cutoff (6000): it chunks, hiredis does not
)
words = st.sampled_from(["EVALSHA", "XADD", "CONFIG GET", "client\tlist", b"XREAD", b"SCRIPT LOAD", "ÉCHO"])


def joined(chunks: list[Any]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


@settings(max_examples=400, deadline=None)
@given(words, st.lists(arguments, max_size=8))
def test_the_same_bytes_as_redis_pys_packer(word: str | bytes, args: list[Any]) -> None:
    ours, theirs = PACKED(), Connection()
    assert joined(ours.pack_command(word, *args)) == joined(theirs.pack_command(word, *args))
    commands = [(word, *args), ("SET", "k", 1.5), (b"GET", b"k")]
    assert joined(ours.pack_commands(commands)) == joined(theirs.pack_commands(commands))


@pytest.mark.parametrize("bad", [None, True, object(), [1], {"a": 1}])
def test_what_redis_py_refuses_is_refused_the_same_way(bad: Any) -> None:
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(DataError, match="Invalid input of type"):
        PACKED().pack_command("SET", "k", bad)


def test_one_packed_class_per_connection_class_keeping_its_name() -> None:
    for cls in (Connection, SSLConnection, UnixDomainSocketConnection, SentinelManagedConnection):
        packed = hiredis_packed(cls)
        assert issubclass(packed, cls) and packed.__name__ == cls.__name__
        assert hiredis_packed(cls) is packed and hiredis_packed(packed) is packed


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:1/0", Connection),
        ("rediss://127.0.0.1:1/0", SSLConnection),
        ("unix:///tmp/nowhere.sock", UnixDomainSocketConnection),
        ("redis+sentinel://127.0.0.1:1/svc", SentinelManagedConnection),
    ],
)
async def test_every_client_connect_makes_packs_with_hiredis(url: str, base: type) -> None:
    client = connect(RedisSettings(url=url))
    try:
        cls = client.connection_pool.connection_class
        assert issubclass(cls, base) and cls is hiredis_packed(base)
    finally:
        await client.aclose()


async def test_a_cluster_clients_nodes_pack_with_hiredis() -> None:
    client = connect(RedisSettings(url="redis+cluster://127.0.0.1:1,127.0.0.1:2"))
    try:
        nodes = list(client.nodes_manager.startup_nodes.values())  # type: ignore[attr-defined]
        assert nodes and all(n.connection_class is hiredis_packed(Connection) for n in nodes)
    finally:
        await client.aclose()


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many commands went through hiredis's packer (one entry per call)."""
    calls: list[int] = []
    real: Callable[..., bytes] = hiredis.pack_command

    def counting(args: Any) -> bytes:
        calls.append(1)
        return real(args)

    monkeypatch.setattr(hiredis, "pack_command", counting)
    return calls


@pytest.mark.redis
async def test_values_round_trip_through_a_real_server(
    client: aioredis.Redis, redis_settings: RedisSettings, packs: list[int]
) -> None:
    key = f"{{{redis_settings.prefix}}}:packing"
    values: list[Any] = ["é ü 漢字 🦙", b"\x00\xff\r\n", 3**40, -7, 0.1, 1e300, memoryview(b"mv"), b"x" * 70_000]
    expect = [
        v.encode() if isinstance(v, str)
        else bytes(v) if isinstance(v, (bytes, memoryview))
        else repr(v).encode() if isinstance(v, float)
        else str(v).encode()
        for v in values
    ]  # fmt: skip
    for i, value in enumerate(values):
        await client.hset(key, str(i), value)
    assert [await client.hget(key, str(i)) for i in range(len(values))] == expect
    async with client.pipeline(transaction=False) as pipe:
        for i in range(len(values)):
            pipe.hget(key, str(i))
        assert await pipe.execute() == expect
    assert await client.eval("return ARGV[1] .. ARGV[2]", 1, key, "é", 2.5) == "é2.5".encode()
    assert len(packs) >= 2 * len(values) + 2  # every command above went through hiredis
    with pytest.raises(DataError):
        await client.set(key, None)  # type: ignore[arg-type]
    await client.delete(key)
