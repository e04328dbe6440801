"""The gateway's event follower: one blocking XREAD for every followed request, against real servers."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.follow import EventFollower
from llamamesh.queue.keys import Keys
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from tests.queue.conftest import raw_client
from tests.redisproc import RedisProcess
from tests.waiting import blocked_in, until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]


@pytest.fixture
async def client(redis_settings: RedisSettings):
    r = raw_client(redis_settings, socket_timeout=30)
    yield r
    await r.aclose()


async def test_a_late_follower_does_not_wait_for_the_blocked_read(redis_settings, client) -> None:
    keys = Keys(redis_settings.prefix)
    f = EventFollower(client, keys, block_ms=10_000)
    try:
        first = await f.follow(keys.events("a"))
        await until(lambda: blocked_in(client, "xread"), 10, 'the loop to block in XREAD (10 s) on stream "a" only')
        late = await f.follow(keys.events("b"))
        t0 = time.monotonic()
        await client.xadd(keys.events("b"), {"e": b"x"})
        _entry_id, fields = await asyncio.wait_for(late.queue.get(), 5)
        assert fields == {b"e": b"x"}
        assert time.monotonic() - t0 < 1.0  # not the 10 s block
        assert first.queue.empty()
    finally:
        await f.close()


async def test_many_followers_share_few_reads(redis_settings, client) -> None:
    keys = Keys(redis_settings.prefix)
    f = EventFollower(client, keys, block_ms=2000)
    try:
        subs = [await f.follow(keys.events(f"r{i}")) for i in range(100)]
        await until(lambda: blocked_in(client, "xread"), 10, "each lane's XREAD", done=lambda n: n >= f.lanes)
        reads_before = f.reads
        async with client.pipeline(transaction=False) as pipe:  # one "engine step" for 100 requests
            for i in range(100):
                pipe.xadd(keys.events(f"r{i}"), {"e": str(i).encode()})
            await pipe.execute()
        got = [await asyncio.wait_for(s.queue.get(), 5) for s in subs]
        assert [fields[b"e"] for _i, fields in got] == [str(i).encode() for i in range(100)]
        # One lane (one blocking read) per event shard at most: on a single server one in all.
        assert f.lanes <= (keys.event_shards if redis_settings.url.startswith("redis+cluster") else 1)
        assert f.reads - reads_before <= 3 * f.lanes
    finally:
        await f.close()


async def test_two_followers_of_one_stream_each_get_what_follows_their_id(redis_settings, client) -> None:
    keys = Keys(redis_settings.prefix)
    key = keys.events("same")
    first_id = (await client.xadd(key, {"e": b"1"})).decode()
    await client.xadd(key, {"e": b"2"})
    f = EventFollower(client, keys, block_ms=500)
    try:
        from_start = await f.follow(key)
        from_first = await f.follow(key, after=first_id)
        a = [(await asyncio.wait_for(from_start.queue.get(), 5))[1][b"e"] for _ in range(2)]
        b = [(await asyncio.wait_for(from_first.queue.get(), 5))[1][b"e"]]
        assert a == [b"1", b"2"] and b == [b"2"]
        assert from_first.queue.empty()
    finally:
        await f.close()


async def test_a_dead_server_reaches_followers_as_an_error() -> None:
    from tests.redisproc import free_port

    r = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    f = EventFollower(r, Keys("t"), block_ms=200)
    try:
        sub = await f.follow("t:x")
        item = await asyncio.wait_for(sub.queue.get(), 5)
        assert isinstance(item, Exception)
        with pytest.raises(QueueUnavailable):
            await f.follow("t:y")  # the loop is reading: the wake-up write fails
    finally:
        await f.close()
        await r.aclose()


async def test_close_returns_while_the_read_is_blocked(redis_settings, client) -> None:
    keys = Keys(redis_settings.prefix)
    f = EventFollower(client, keys, block_ms=10_000)
    sub = await f.follow(keys.events("z"))
    await client.xadd(keys.events("z"), {"e": b"1"})
    await asyncio.wait_for(sub.queue.get(), 5)
    f.unfollow(sub)  # the loop is back in a 10 s XREAD on a stream nobody follows
    await asyncio.wait_for(f.close(), 5)


async def test_followers_of_one_stream_joining_while_it_is_read_each_get_all_of_it(redis_settings, client) -> None:
    """Followers of one long stream (a finished request read by several Attach calls at once), each
    joining while the lane's read of it is in flight (from further on, for those before it): each
    gets every entry after its own place, none skipped."""
    keys = Keys(redis_settings.prefix)
    key = keys.events("long")
    async with client.pipeline(transaction=False) as pipe:
        for i in range(3000):
            pipe.xadd(key, {"e": str(i).encode()})
        await pipe.execute()
    f = EventFollower(client, keys, block_ms=500)
    try:
        subs = []
        for _ in range(8):  # each joins at another point of the others' reading
            subs.append(await f.follow(key))
            await asyncio.sleep(0)
        for sub in subs:
            got = [int((await asyncio.wait_for(sub.queue.get(), 10))[1][b"e"]) for _ in range(3000)]
            assert got == list(range(3000))
    finally:
        await f.close()


async def test_a_paused_server_reaches_followers_within_the_outage_grace(tmp_path: Path) -> None:
    """A Redis that stops answering without closing its connections (SIGSTOP: a hung host) ends
    the followers' wait once the outage grace has passed, not at the client's socket timeouts."""
    server = RedisProcess("redis", tmp_path / "redis")
    server.start()
    settings = RedisSettings(url=server.url, block_ms=300, outage_grace_s=2.0)
    q = RedisQueue.from_settings(settings)  # the product's client: 10.3 s socket timeout, a retry
    f = EventFollower(q.client, Keys(settings.prefix), block_ms=settings.block_ms, outage_grace_s=2.0)
    assert server.proc is not None
    try:
        sub = await f.follow("t:x")
        await until(lambda: f.reads >= 1, 10, "a read to return")
        server.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        item = await asyncio.wait_for(sub.queue.get(), 20)
        took = time.monotonic() - t0
        assert isinstance(item, Exception), item
        assert took < 2.0 + 2 * (0.3 + 3.0) + 1.0, took  # the grace, and at most two bounded reads past it
    finally:
        server.proc.send_signal(signal.SIGCONT)
        await f.close()
        await q.close()
        server.stop()
