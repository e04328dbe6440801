"""LLAMAMESH_REDIS_URL for Sentinel: parsed in one place (settings.py), refused at start when
malformed, and the client redisio.connect makes of it (lazily: nothing here connects)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from llamamesh.errors import QueueUnavailable
from llamamesh.queue.redisio import Replicas, connect, hiredis_packed, tls_options
from llamamesh.settings import RedisSettings, SentinelUrl, Settings, parse_sentinel_url

pytestmark = pytest.mark.timeout(10)


def test_the_parts_of_a_sentinel_url() -> None:
    assert parse_sentinel_url("redis+sentinel://a:1,b,[::1]:3/mymaster/2") == SentinelUrl(
        sentinels=(("a", 1), ("b", 26379), ("::1", 3)), service="mymaster", db=2
    )
    u = parse_sentinel_url("rediss+sentinel://me:p%40ss%2Fw@h:26380/svc/")
    assert (u.username, u.password, u.tls, u.db, u.sentinels) == ("me", "p@ss/w", True, 0, (("h", 26380),))
    u = parse_sentinel_url("redis+sentinel://:secret@h/svc")
    assert (u.username, u.password) == (None, "secret")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel:///svc", "no Sentinel host:port"),
        ("redis+sentinel://,/svc", "no Sentinel host:port"),
        ("redis+sentinel://h:1", "no service name"),
        ("redis+sentinel://h:1/", "no service name"),
        ("redis+sentinel://h:x/svc", "bad port"),
        ("redis+sentinel://h:70000/svc", "bad port"),
        ("redis+sentinel://::1/svc", "IPv6 goes in"),
        ("redis+sentinel://[::1/svc", "cannot read Sentinel address"),
        ("redis+sentinel://h/svc/zero", "the db must be a number"),
        ("redis+sentinel://h/svc/0/1", "too many path parts"),
        ("redis+sentinel://h/svc?ssl=1", "no query"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_at_start_saying_why(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        Settings.from_env({"LLAMAMESH_REDIS_URL": url})
    assert "LLAMAMESH_REDIS_URL" in str(caught.value)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://127.0.0.1:notaport", "its port must be a number"),
        ("redis://127.0.0.1:99999", "its port must be a number"),
        ("redis://:hunter2@", "expected redis://"),
        ("redis://h/abc", "the db \\(its path\\) must be a number"),
        ("unix://", "unix://<path"),
        ("redis+cluster://", "host:port"),
        ("redis+cluster://h:abc", "host:port"),
        ("redis+cluster://127.0.0.1:7000,", "host:port"),
    ],
)
def test_a_malformed_server_or_cluster_url_is_refused_at_start_saying_why(url: str, says: str) -> None:
    """Refused when the settings are read, in one line naming the variable: not later, by the Redis
    client, as a traceback (the gateway and workers connect only after they started)."""
    with pytest.raises(ValueError, match=f"^LLAMAMESH_REDIS_URL: .*{says}") as caught:
        Settings.from_env({"LLAMAMESH_REDIS_URL": url})
    assert "hunter2" not in str(caught.value)
    for good in ("redis://h:6379/0", "rediss://u:p@h:6380", "unix:///tmp/r.sock", "redis://h?db=2"):
        Settings.from_env({"LLAMAMESH_REDIS_URL": good})


def test_a_tls_file_that_is_not_there_is_refused_by_the_process_that_needs_it(tmp_path: Path) -> None:
    """The settings parse where the files are not (a pod's env checked elsewhere); a gateway or
    worker process refuses them at start, in one line naming the variable."""
    ca = tmp_path / "ca.pem"
    settings = Settings.from_env({"LLAMAMESH_REDIS_URL": "rediss://h:6380", "LLAMAMESH_REDIS_TLS_CA": str(ca)})
    with pytest.raises(ValueError, match=f"^LLAMAMESH_REDIS_TLS_CA: no such file: {ca}$"):
        settings.checked_for_process()
    ca.write_text("(a PEM)")
    assert settings.checked_for_process().redis.tls_ca == str(ca)
    plain = Settings.from_env({"LLAMAMESH_REDIS_URL": "redis://h:6379", "LLAMAMESH_REDIS_TLS_CA": str(ca)})
    with pytest.raises(ValueError, match=r"^LLAMAMESH_REDIS_TLS_.* LLAMAMESH_REDIS_URL is not rediss://"):
        plain.checked_for_process()


def test_an_error_never_quotes_the_password() -> None:
    with pytest.raises(ValueError, match="bad port") as caught:
        RedisSettings(url="redis+sentinel://u:hunter2@h:x/svc")
    assert "hunter2" not in str(caught.value)


def test_the_wait_settings_are_checked() -> None:
    s = Settings.from_env({"LLAMAMESH_REDIS_WAIT_REPLICAS": "1", "LLAMAMESH_REDIS_WAIT_TIMEOUT_MS": "250"})
    assert Replicas.of(s.redis) == Replicas(1, 250)
    with pytest.raises(ValueError, match="WAIT_REPLICAS"):
        RedisSettings(wait_replicas=-1)
    with pytest.raises(ValueError, match="WAIT_TIMEOUT_MS"):
        RedisSettings(wait_replicas=1, wait_timeout_ms=0)  # WAIT n 0 would block forever


def test_replicas_check_the_reply_of_wait() -> None:
    assert Replicas().check([1, 2], "x") == [1, 2]  # off: nothing was queued
    assert Replicas(1).check(["a", 1], "x") == ["a"]
    with pytest.raises(QueueUnavailable, match="the submission reached 0 of the 2 Redis replicas"):
        Replicas(2, 100).check(["a", 0], "the submission")


async def test_connect_dispatches_a_sentinel_url_to_a_sentinel_client() -> None:
    s = RedisSettings(url="redis+sentinel://u:pw@127.0.0.1:1,127.0.0.1:2/svc/3", block_ms=500, retries=2)
    client = connect(s)
    try:
        pool = client.connection_pool
        kw = pool.connection_kwargs
        assert pool.service_name == "svc" and pool.connection_class is hiredis_packed(SentinelManagedConnection)  # type: ignore[attr-defined]
        assert (kw["db"], kw["username"], kw["password"]) == (3, "u", "pw")
        # the same options as the plain client's connections
        assert kw["socket_timeout"] == 10.5 and kw["health_check_interval"] == 1 and kw["retry"].get_retries() == 2
        sentinels = pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
        assert [c.connection_pool.connection_kwargs["port"] for c in sentinels] == [1, 2]
        assert all(c.connection_pool.connection_kwargs.get("password") is None for c in sentinels)
    finally:
        await client.aclose()


async def test_rediss_sentinel_speaks_tls_to_the_data_nodes(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    s = RedisSettings(url="rediss+sentinel://127.0.0.1:1/svc", tls_ca=str(ca))
    client = connect(s)
    try:
        pool = client.connection_pool
        assert pool.connection_class is hiredis_packed(SentinelManagedSSLConnection)
        assert pool.connection_kwargs["ssl_ca_certs"] == str(ca)
    finally:
        await client.aclose()
    with pytest.raises(ValueError, match="not rediss://"):
        tls_options(RedisSettings(url="redis+sentinel://127.0.0.1:1/svc", tls_ca=str(ca)))
