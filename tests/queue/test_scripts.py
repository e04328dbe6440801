"""The queue's Lua scripts (llamamesh/queue/lua/, read by scripts.py) and its one table of lifetimes
(``keys.Retention``): every script loads whole and compiles on each server kind."""

from __future__ import annotations

from importlib.resources import files

import pytest
import redis.asyncio as aioredis

from llamamesh.queue.keys import CANCEL_AHEAD_TTL_S, SUBMITTED_TTL_S, Retention
from llamamesh.queue.scripts import source
from llamamesh.settings import BatchSettings, RedisSettings

pytestmark = pytest.mark.timeout(30)

NAMES = sorted(
    p.name.removesuffix(".lua") for p in (files("llamamesh.queue") / "lua").iterdir() if p.name.endswith(".lua")
)


def test_every_script_is_sent_without_its_comments_and_with_its_includes() -> None:
    assert len(NAMES) >= 25
    for name in NAMES:
        text = source(name)
        assert text.strip() and not text.startswith("--"), name
        assert "--! include" not in text, name
    assert source("record_result").startswith(source("batch_finish").rstrip("\n"))
    assert "local function finish" in source("skip_unstarted")
    assert source("admit").startswith("local t = redis.call('TIME')")


def test_a_script_with_no_file_is_refused() -> None:
    with pytest.raises(FileNotFoundError):
        source("no_such_script")


@pytest.mark.redis
async def test_every_script_compiles_on_each_server(client: aioredis.Redis) -> None:
    for name in NAMES:
        if name in ("batch_finish", "redis_now"):  # included by others, never run alone
            continue
        assert await client.script_load(source(name)), name


def test_retention_is_built_once_from_the_settings() -> None:
    assert Retention() == Retention.of()
    kept = Retention.of(
        RedisSettings(event_ttl_s=5, event_idle_ttl_s=30, dead_letter_maxlen=7, consumer_idle_s=9),
        BatchSettings(retention_s=11),
    )
    assert (kept.event_s, kept.event_idle_s, kept.dead_letters, kept.consumer_idle_s, kept.batch_s) == (5, 30, 7, 9, 11)
    assert kept.submitted_ttl_s == min(SUBMITTED_TTL_S, 30) and kept.cancel_ahead_s == CANCEL_AHEAD_TTL_S
    assert Retention.of(RedisSettings(event_idle_ttl_s=10)).submitted_ttl_s == 10  # never past the request's
