"""Redis Cluster: the url's nodes, the event shards' slots, the hash tags of every multi-key script."""

from __future__ import annotations

import pytest
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from llamamesh.queue.cluster import stream_keys
from llamamesh.queue.follow import hash_tag
from llamamesh.queue.keys import Keys
from llamamesh.queue.redisio import cluster_nodes, connect, is_cluster
from llamamesh.queue.slots import shard_tags
from llamamesh.settings import RedisSettings

pytestmark = pytest.mark.timeout(30)


def test_a_cluster_url_lists_its_nodes_and_credentials() -> None:
    assert cluster_nodes("redis+cluster://a:7000,b:7001") == ([("a", 7000), ("b", 7001)], {})
    assert cluster_nodes("redis+cluster://u:p%40ss@a:7000") == ([("a", 7000)], {"username": "u", "password": "p@ss"})
    assert cluster_nodes("rediss+cluster://:secret@[::1]:7000/0") == ([("::1", 7000)], {"password": "secret"})
    for bad, why in [
        ("redis+cluster://a", "host:port"),
        ("redis+cluster://a:x", "host:port"),
        ("redis+cluster://a:1/2", "database 0"),
        ("redis://a:1", "not a cluster"),
    ]:
        with pytest.raises(ValueError, match=why):
            cluster_nodes(bad)
    assert is_cluster(connect(RedisSettings(url="redis+cluster://127.0.0.1:7000")))
    assert not is_cluster(connect(RedisSettings(url="redis://127.0.0.1:6379")))


def test_the_stream_keys_of_xread_and_xreadgroup_are_read_from_the_command() -> None:
    """What the cluster client routes XREAD and XREADGROUP by, without asking a node."""
    assert stream_keys("XREAD", ("COUNT", 10, "BLOCK", 100, "STREAMS", "a", "b", "0", "$")) == ("a", "b")
    assert stream_keys(b"xreadgroup", (b"GROUP", b"streams", b"streams", b"STREAMS", b"k", b">")) == (b"k",)
    assert stream_keys("XREADGROUP", ("GROUP", "g", "c", "NOACK", "streams", "k", ">")) == ("k",)
    assert stream_keys("GET", ("k",)) is None and stream_keys("EVALSHA", ("sha", 1, "k")) is None
    for bad in [("STREAMS",), ("STREAMS", "a", "b", "0"), ("COUNT", 1), ()]:
        with pytest.raises(RedisClusterException, match="Invalid args"):
            stream_keys("XREAD", bad)


def test_event_shards_cover_the_slot_space_evenly_and_every_id_lands_in_one() -> None:
    for shards in (1, 3, 16, 64):
        slots = [key_slot(t.encode()) for t in shard_tags(shards)]
        assert [s * shards // 16384 for s in slots] == list(range(shards))  # shard k in the k-th range
    keys = Keys("p", 16)
    tags = {hash_tag(keys.events(f"r{i}")) for i in range(2000)}
    assert tags == set(shard_tags(16))  # a few slots, all used, whatever the ids
    assert keys.events("a{b}c") == keys.events("a{b}c") and hash_tag(keys.events("a{b}c")) in tags
    with pytest.raises(ValueError, match="LLAMAMESH_REDIS_EVENT_SHARDS=0: expected an integer, from 1 to 16384"):
        RedisSettings(url="redis://127.0.0.1:1", event_shards=0)


def test_the_keys_each_script_names_share_one_slot() -> None:
    k = Keys("p")
    groups = [
        [k.jobs("cpu", "t"), k.submitted("cpu", "r"), k.tenants("cpu"), k.jobs_part("cpu", "t", 3), k.owners("cpu"),
         k.partitions("cpu"), k.dead_letters("cpu"), k.batch_items("cpu"), k.workers("cpu"), k.worker("cpu", "w"),
         k.batch_lane("cpu", "b"), k.batch_lane("cpu", "x{y}"), k.batch_lanes("cpu"), k.batch_lanes_open("cpu"),
         k.batch_holds("cpu")],
        [k.cancel("r"), k.attempts("r"), k.attaches("r"), k.called_off("r")],
        [k.batch("b"), k.batch_done("b"), k.batch_results("b"), k.batch_ids("b"), k.batch_started("b")],
        [k.tenant_rate("t"), k.tenant_streams("t"), k.tenant_batch_quota("t"), k.tenant_batches_held("t")],
    ]  # fmt: skip
    for group in groups:
        assert len({key_slot(key.encode()) for key in group}) == 1, group


def test_our_slot_function_is_redis_pys() -> None:
    from llamamesh.queue import slots

    samples = [b"", b"a", b"llamamesh:v1:pool:{cpu}:jobs", b"{}x", b"x{}y", b"{a}{b}", b"e3.17", b"\xff\x00{t:acme}"]
    samples += [f"req:{{r{i}}}:attempts".encode() for i in range(500)]
    assert [slots.key_slot(k) for k in samples] == [key_slot(k) for k in samples]
