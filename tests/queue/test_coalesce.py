"""ScriptPipe (llamamesh/queue/coalesce.py): concurrent callers' scripts in one pipeline, against real
servers (redis-server, Valkey; on the cluster every call goes out on its own)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.coalesce import MOST_PER_PIPELINE, ScriptPipe
from llamamesh.queue.redisio import Replicas, is_cluster
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import Attempt
from tests.queue.conftest import single_server_only
from tests.queue.jobs import req
from tests.waiting import until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30)]

# KEYS[1]: a counter. ARGV[1]: a word; "bad" is refused. Returns the word and the counter's count.
ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('ERR refused ' .. ARGV[1]) end
return {ARGV[1], redis.call('INCR', KEYS[1])}
"""


def key(settings: RedisSettings, name: str) -> str:
    return f"{settings.prefix}:{{t}}:{name}"  # one hash tag: one slot on the cluster


async def test_concurrent_calls_go_out_together_each_with_its_own_reply(
    client: aioredis.Redis, redis_settings: RedisSettings
) -> None:
    pipe, echo = ScriptPipe(client), client.register_script(ECHO)
    await pipe.call(echo, [key(redis_settings, "n")], ["loaded"])  # the server knows the script now
    sent = pipe.pipelines, pipe.scripts
    n = MOST_PER_PIPELINE + 44  # more than one pipeline holds
    replies = await asyncio.gather(*(pipe.call(echo, [key(redis_settings, "n")], [f"w{i}"]) for i in range(n)))
    assert [r[0][0] for r in replies] == [f"w{i}".encode() for i in range(n)]
    assert sorted(int(r[0][1]) for r in replies) == list(range(2, n + 2))  # each ran once
    if is_cluster(client):
        assert pipe.pipelines == 0  # a cluster's pipelines cannot hold scripts: each went alone
    else:
        assert (pipe.pipelines - sent[0], pipe.scripts - sent[1]) == (2, n)
    await pipe.close()


async def test_an_error_reply_reaches_its_own_caller_only(
    client: aioredis.Redis, redis_settings: RedisSettings
) -> None:
    pipe, echo = ScriptPipe(client), client.register_script(ECHO)
    calls = (pipe.call(echo, [key(redis_settings, "e")], [w]) for w in ["a", "bad", "c"])
    out = await asyncio.gather(*calls, return_exceptions=True)
    assert [r[0][0] for r in (out[0], out[2])] == [b"a", b"c"]  # type: ignore[index]
    assert isinstance(out[1], ResponseError) and "refused bad" in str(out[1])


async def test_scripts_the_server_forgot_are_loaded_again(
    client: aioredis.Redis, redis_settings: RedisSettings
) -> None:
    pipe, echo = ScriptPipe(client), client.register_script(ECHO)
    assert (await pipe.call(echo, [key(redis_settings, "f")], ["x"]))[0][1] == 1
    await client.script_flush()  # as after a restart
    replies = await asyncio.gather(*(pipe.call(echo, [key(redis_settings, "f")], [str(i)]) for i in range(5)))
    assert sorted(int(r[0][1]) for r in replies) == [2, 3, 4, 5, 6]  # each ran once, after the reload


async def test_a_caller_cancelled_before_its_pipeline_left_never_runs(
    client: aioredis.Redis, redis_settings: RedisSettings
) -> None:
    single_server_only(redis_settings, "a cluster sends each call at once")
    pipe, echo = ScriptPipe(client), client.register_script(ECHO)
    gone = asyncio.create_task(pipe.call(echo, [key(redis_settings, "c")], ["gone"]))
    # Looked at every turn: its pipeline leaves on the turn after the call is queued.
    await until(lambda: len(pipe._queued) == 1, 5, "the call to be queued", poll_s=0)
    gone.cancel()
    stays = await pipe.call(echo, [key(redis_settings, "c")], ["stays"])
    assert gone.cancelled()
    assert stays[0] == [b"stays", 1]  # the first call never ran


async def test_close_cancels_the_calls_still_queued(client: aioredis.Redis, redis_settings: RedisSettings) -> None:
    single_server_only(redis_settings, "a cluster sends each call at once")
    pipe, echo = ScriptPipe(client), client.register_script(ECHO)
    calls = [asyncio.create_task(pipe.call(echo, [key(redis_settings, "q")], [str(i)])) for i in range(3)]
    await until(lambda: len(pipe._queued) == 3, 5, "the calls to be queued", poll_s=0)
    await pipe.close()
    await asyncio.wait(calls, timeout=5)
    assert all(c.cancelled() for c in calls)
    assert await client.get(key(redis_settings, "q")) is None


async def test_a_failed_pipeline_fails_each_of_its_callers() -> None:
    dead = aioredis.Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=1)  # nobody listens
    pipe, echo = ScriptPipe(dead), dead.register_script(ECHO)
    out = await asyncio.gather(*(pipe.call(echo, ["k"], [str(i)]) for i in range(3)), return_exceptions=True)
    assert all(isinstance(e, RedisConnectionError) for e in out)
    assert len({id(e) for e in out}) == 3  # each caller its own copy
    await dead.aclose()


async def test_one_wait_covers_the_pipeline_and_every_caller_gets_its_reply(
    client: aioredis.Redis, redis_settings: RedisSettings
) -> None:
    single_server_only(redis_settings, "WAIT is for one primary")
    pipe, echo = ScriptPipe(client, Replicas(count=1, timeout_ms=10)), client.register_script(ECHO)
    replies = await asyncio.gather(*(pipe.call(echo, [key(redis_settings, "w")], [str(i)]) for i in range(4)))
    assert [r[1] for r in replies] == [0, 0, 0, 0]  # WAIT's reply: no replica acknowledged (there is none)
    assert pipe.pipelines == 1


async def test_a_burst_of_new_requests_each_begins_and_is_queued_once(redis_queue: RedisQueue) -> None:
    q = redis_queue
    await q.join("cpu")
    ids = [f"r{i}" for i in range(100)]

    async def new(rid: str) -> bool:
        first = await q.begin(rid, Attempt(rid, 0, "cpu", "m", 1, False), first=True)
        await q.submit("cpu", req(rid))
        return first

    assert all(await asyncio.gather(*(new(r) for r in ids)))
    assert not await q.begin("r7", Attempt("r7", 0, "cpu", "m", 2, False), first=True)  # another request's id
    leased = await q.lease("cpu", "w", 200, 100)
    assert sorted(x.request.request_id for x in leased) == sorted(ids)


async def test_a_submission_without_its_replicas_is_unavailable(redis_settings: RedisSettings) -> None:
    single_server_only(redis_settings, "WAIT is for one primary")
    q = RedisQueue.from_settings(replace(redis_settings, wait_replicas=1, wait_timeout_ms=10))
    try:
        await q.join("cpu")
        out = await asyncio.gather(*(q.submit("cpu", req(f"s{i}")) for i in range(3)), return_exceptions=True)
        assert all(isinstance(e, QueueUnavailable) and "0 of the 1 Redis replicas" in str(e) for e in out)
    finally:
        await q.close()
