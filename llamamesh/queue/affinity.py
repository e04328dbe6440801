"""Prefix affinity: a pool's work split into partition streams, each owned by one of its workers.

With ``RedisSettings.affinity_partitions`` P > 0 every (pool, tenant) work stream becomes P
partition streams (``Keys.jobs_part``), a job's chosen by the hash of its prefix key
(``partition_of``). Each partition has one owner among the pool's ready workers (``Keys.owners``),
shared out by their heartbeats (``assign``; lua/own_partitions.lua is its twin on Redis). A worker
leases from its own partitions first and steals from the others' only when idle (lease.py).
docs/affinity.md has the design and its trade-offs. A batch's items are queued with each prefix
key's items together (``grouped``), for one worker to lease a group (lanes.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice

from llamamesh.types import GenerationRequest

# Field prefix of a member's entry in the owners hash (partition fields are bare numbers).
MEMBER = "m:"
# Balanced placement: the most prefix keys a pool remembers (past it, the least recently used is
# forgotten), and how many keys unused for the ttl one submission forgets at most.
MOST_PLACED = 100_000
FORGET_EACH = 8


def partition_of(request: GenerationRequest, partitions: int) -> int:
    """The partition of a job among ``partitions`` (> 0): the hash (blake2b) of its prefix key, or
    of its request id when it has none (spread, no affinity)."""
    key = request.prefix_key or request.request_id
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


def placement_field(tenant: str, key: str) -> str:
    """A prefix key's name in a pool's placements: each tenant's keys apart."""
    return f"{tenant}\n{key}"


def least_loaded(
    hashed: int, partitions: int, load: Mapping[int, int], owners: Mapping[int, tuple[str, int]], now_ms: int
) -> int:
    """Where balanced placement puts a prefix key it has not seen: among the partitions of the
    live owner with the fewest keys placed (partitions without one count as one more owner's),
    the one with the fewest, the first from ``hashed`` on among equals. lua/submit.lua is its twin."""

    def whose(k: int) -> str:
        owner = owners.get(k)
        return owner[0] if owner is not None and owner[1] > now_ms else ""

    per: dict[str, int] = {}
    for k in range(partitions):
        per[whose(k)] = per.get(whose(k), 0) + load.get(k, 0)
    best, score = hashed, (per[whose(hashed)], load.get(hashed, 0))
    for i in range(1, partitions):
        k = (hashed + i) % partitions
        if (mine := (per[whose(k)], load.get(k, 0))) < score:
            best, score = k, mine
    return best


@dataclass
class Placements:
    """A pool's balanced placement of prefix keys in memory (lua/submit.lua's twin): each key stays
    in the partition it was first put in (``least_loaded``) while it is used within ``ttl_ms``."""

    ttl_ms: int
    where: dict[str, int] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)  # key -> last use (ms), least recent first
    load: dict[int, int] = field(default_factory=dict)  # partition -> keys placed there

    def place(self, key: str, hashed: int, partitions: int, owners: Mapping[int, tuple[str, int]], now_ms: int) -> int:
        for old in [f for f, t in islice(self.used.items(), FORGET_EACH) if t <= now_ms - self.ttl_ms]:
            self._forget(old)
        k = self.where.get(key)
        if k is None or k >= partitions:
            if k is not None:
                self._forget(key)
            k = least_loaded(hashed, partitions, self.load, owners, now_ms)
            if len(self.used) >= MOST_PLACED:
                self._forget(next(iter(self.used)))
            self.where[key] = k
            self.load[k] = self.load.get(k, 0) + 1
        self.used.pop(key, None)
        self.used[key] = now_ms
        return k

    def _forget(self, key: str) -> None:
        k = self.where.pop(key, None)
        if k is not None:
            self.load[k] -= 1
        self.used.pop(key, None)


def grouped(items: Sequence[tuple[str, GenerationRequest]]) -> list[tuple[str, GenerationRequest]]:
    """``(pool, request)`` items with each prefix key's items together, the groups in the order of
    their first item (a stable sort: within a group, the items keep their order)."""
    first: dict[str, int] = {}
    for n, (_pool, req) in enumerate(items):
        first.setdefault(req.prefix_key, n)
    return sorted(items, key=lambda item: first[item[1].prefix_key])


def share(partitions: int, live: int, short: bool) -> int:
    """How many partitions a worker may hold among ``live`` members: P // live, or one more while
    they do not divide evenly and no other member holds fewer than P // live (``short``), so that
    every member gets at least P // live and none waits with nothing while another holds extra."""
    quota, extra = divmod(partitions, live)
    return quota + 1 if extra and not short else quota


def assign(
    owners: Mapping[int, tuple[str, int]],
    members: Mapping[str, int],
    me: str,
    now_ms: int,
    ttl_ms: int,
    partitions: int,
) -> tuple[dict[int, tuple[str, int]], dict[str, int], list[int]]:
    """One ownership step of worker ``me`` (a ready worker's heartbeat): the new owners (partition
    -> (worker, expiry ms)), the new members (worker -> expiry ms, expired ones gone) and the
    partitions ``me`` owns now, in order. lua/own_partitions.lua is the same step on Redis.

    It renews ``me``'s membership and partitions, takes partitions that are unowned or whose
    owner's lease expired, and holds about ceil(P / members), giving back extras so that a worker
    that joins gets its share (``share``). A dead worker's partitions expire with its heartbeat TTL
    and go to the others at their next heartbeats."""
    live = {w: until for w, until in members.items() if until > now_ms}
    live[me] = now_ms + ttl_ms
    new: dict[int, tuple[str, int]] = {}
    mine: list[int] = []
    free: list[int] = []
    held: dict[str, int] = {}
    for k in range(partitions):
        owner = owners.get(k)
        if owner is not None and owner[0] == me:
            mine.append(k)
        elif owner is None or owner[1] <= now_ms:
            free.append(k)
        else:
            new[k] = owner
            held[owner[0]] = held.get(owner[0], 0) + 1
    target = share(partitions, len(live), any(held.get(w, 0) < partitions // len(live) for w in live if w != me))
    kept = mine[:target] + free[: max(0, target - len(mine))]
    for k in sorted(kept):
        new[k] = (me, now_ms + ttl_ms)
    return new, live, sorted(kept)
