"""Redis Cluster's slot of a key (``key_slot``) and the hash tags that spread the request event
streams evenly over the slot space (``shard_tags``): pure arithmetic, no Redis client, so that
naming keys (keys.py) needs none."""

from __future__ import annotations

import functools

REDIS_CLUSTER_HASH_SLOTS = 16384


def key_slot(key: bytes) -> int:
    """The Redis Cluster slot of ``key``: CRC16 (XMODEM) of its hash tag (the text between the first
    ``{`` and the next ``}``, when not empty) or of the whole key, modulo 16384. Here rather than
    redis-py's, so that naming keys needs no Redis client (the gateway's handlers import this)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    crc = 0
    for byte in key:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc % REDIS_CLUSTER_HASH_SLOTS


@functools.lru_cache(maxsize=8)
def shard_tags(shards: int) -> tuple[str, ...]:
    """A hash tag for each event shard: shard k's hashes into the k-th of ``shards`` equal ranges
    of the slot space, so that a cluster whose masters own equal ranges (``redis-cli --cluster
    create``) gets an even share of the shards on each. Deterministic: every process agrees."""
    if not 1 <= shards <= REDIS_CLUSTER_HASH_SLOTS:
        raise ValueError(f"event shards must be 1..{REDIS_CLUSTER_HASH_SLOTS}, not {shards}")
    tags: list[str] = []
    for k in range(shards):
        low, high = k * REDIS_CLUSTER_HASH_SLOTS // shards, (k + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        n = 0
        while not low <= key_slot(f"e{k}.{n}".encode()) < high:
            n += 1
        tags.append(f"e{k}.{n}")
    return tuple(tags)
