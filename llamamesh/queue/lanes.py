"""Where a pool's batch items wait: one lane (a stream) per batch (``Keys.batch_lane``), listed by
deadline while it has items to lease (``Keys.batch_lanes``) and as long as it exists
(``Keys.batch_lanes_open``), all in the pool's slot. Workers lease the earliest deadline first
(lease_items.lua) and the items of one prefix group from the worker that took its start, for a
while (``Keys.batch_holds``); they reclaim and touch items in whichever lane holds them. The pool's shared
batch stream (``Keys.batch_items``) is drained first, so that items queued there are not lost.
Redis errors become QueueUnavailable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from llamamesh.queue import batch_record, groups
from llamamesh.queue.keys import (
    GROUP_FIELD,
    JOB_FIELD,
    LEASE_LANES,
    PREFIX_HOLD_MS,
    WORKER_GROUP,
    Keys,
    lane_batch,
    lane_member,
)
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.scripts import register
from llamamesh.types import BatchInfo, GenerationRequest

# How many open lanes of a pool one reclaim looks at (the next call goes on after them).
RECLAIM_LANES = 32
# Where reclaims go on in each stream is forgotten past this many streams (they start again).
MAX_CURSORS = 4096

# A leased or claimed entry: (batch id, "" for the shared stream; entry id; its fields).
Entry = tuple[str, str, dict[bytes, bytes]]


def entry_fields(request: GenerationRequest, job: bytes) -> dict[str, bytes | str]:
    """A lane entry: the encoded job and, when it has one, its prefix key."""
    fields: dict[str, bytes | str] = {JOB_FIELD: job}
    if request.prefix_key:
        fields[GROUP_FIELD] = request.prefix_key
    return fields


class BatchLanes:
    """The lanes of every pool (see the module's docstring)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, hold_ms: int = PREFIX_HOLD_MS) -> None:
        self._r = client
        self.keys = keys
        self.hold_ms = hold_ms
        self._lease = register(client, "lease_items")
        self._touch = register(client, "touch_owned")
        # Where the next reclaim of each stream goes on scanning its pending entries.
        self._claim_from: dict[str, bytes | str] = {}
        # pool -> the rank (in the open lanes) of the first lane its next reclaim looks at.
        self._claim_lane: dict[str, int] = {}
        # pool -> the rank of the first lane the next ``open_streams`` gives.
        self._prune_lane: dict[str, int] = {}

    def stream(self, pool: str, batch_id: str) -> str:
        """The stream of ``pool`` that holds a batch's items ("": the shared stream)."""
        return self.keys.batch_lane(pool, batch_id) if batch_id else self.keys.batch_items(pool)

    def queue(self, pipe: Any, info: BatchInfo, entries: Iterable[tuple[str, GenerationRequest, bytes]]) -> list[str]:
        """Queue on ``pipe`` the XADD of each ``(pool, request, job)`` onto its lane, then list
        each lane for leasing (after its entries: a lane a worker finds empty in between is listed
        again). Returns the pools in the order of their listing commands, which follow the XADDs."""
        pools: list[str] = []
        for pool, request, job in entries:
            pipe.xadd(self.keys.batch_lane(pool, info.batch_id), entry_fields(request, job))
            if pool not in pools:
                pools.append(pool)
        member = lane_member(info.created_at, info.batch_id)
        for pool in pools:
            pipe.zadd(self.keys.batch_lanes_open(pool), {member: info.expires_at})
            pipe.zadd(self.keys.batch_lanes(pool), {member: info.expires_at})
        return pools

    async def lease(self, pool: str, consumer: str, count: int) -> list[Entry]:
        """Up to ``count`` new items of the pool (lease_items.lua: earliest deadline first, prefix
        groups kept for the worker that took their start)."""
        if count <= 0:  # (XREADGROUP reads without bound at COUNT 0)
            return []
        k = self.keys
        with unreachable("cannot read the batch lanes"):
            reply: Any = await self._lease(
                keys=[k.batch_lanes(pool), k.batch_holds(pool), k.batch_items(pool)],
                args=[WORKER_GROUP, consumer, count, k.batch_lane(pool, ""), self.hold_ms, LEASE_LANES, GROUP_FIELD],
            )
        return [(bid.decode(), eid.decode(), _fields(flat)) for bid, eid, flat in reply]

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Entry]:
        """Take over up to ``count`` items leased and untouched for ``min_idle_ms`` (their worker
        died): from the shared stream, then from up to ``RECLAIM_LANES`` open lanes, the next call
        going on with the lanes after them (back at the first once it has been through all).

        XAUTOCLAIM looks at ``10 x count`` pending entries of a stream per call: each call goes on
        from where the last one stopped in that stream, so an item a dead worker left behind many
        live workers' running ones is found within a few calls."""
        start = self._claim_lane.get(pool, 0)
        with unreachable("cannot read the batch lanes"):
            members: Any = await self._r.zrange(self.keys.batch_lanes_open(pool), start, start + RECLAIM_LANES - 1)
        self._claim_lane[pool] = start + RECLAIM_LANES if len(members) == RECLAIM_LANES else 0
        streams = [("", self.keys.batch_items(pool))]
        streams += [(bid, self.keys.batch_lane(pool, bid)) for bid in (_batch(m) for m in members)]
        if len(self._claim_from) > MAX_CURSORS:
            self._claim_from.clear()
        out: list[Entry] = []
        for bid, stream in streams:
            if len(out) >= count:
                break
            claimed = await self._claim(stream, consumer, min_idle_ms, count - len(out))
            out += [(bid, eid, fields) for eid, fields in claimed]
        return out

    async def _claim(self, stream: str, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, Any]]:
        with unreachable("cannot claim from the batch lanes"):
            try:
                reply: Any = await self._r.xautoclaim(
                    stream, WORKER_GROUP, consumer, min_idle_ms, self._claim_from.get(stream, "0-0"), count=count
                )
            except ResponseError as exc:
                if not groups.gone(exc):
                    raise
                self._claim_from.pop(stream, None)
                return []
        cursor = reply[0]
        if cursor in (b"0-0", "0-0"):
            self._claim_from.pop(stream, None)
        else:
            self._claim_from[stream] = cursor
        return [(e[0].decode(), e[1]) for e in reply[1] if e and e[1]]

    async def touch(self, pool: str, consumer: str, refs: Sequence[str]) -> list[str]:
        """Reset the idle time of items ``consumer`` still runs (``Lease.item_ref`` each), so nobody
        reclaims them; one script per stream, in one round trip. Returns those another consumer took
        over meanwhile (``groups.touch_owned``). A lane gone has nothing to touch."""
        by_stream: dict[str, dict[str, str]] = {}
        for ref in refs:
            bid, eid = split_item_ref(ref)
            by_stream.setdefault(self.stream(pool, bid), {})[eid] = ref
        return await groups.touch_owned(self._r, self._touch, consumer, by_stream)

    async def open_streams(self, pool: str, limit: int = RECLAIM_LANES) -> list[str]:
        """The pool's shared stream and ``limit`` of its open lanes, the next call going on with the
        lanes after them (back at the first once it has been through all): what one call costs
        stays bounded however many batches are open."""
        start = self._prune_lane.get(pool, 0)
        with unreachable():
            members: Any = await self._r.zrange(self.keys.batch_lanes_open(pool), start, start + limit - 1)
        self._prune_lane[pool] = start + limit if len(members) == limit else 0
        return [self.keys.batch_items(pool), *(self.keys.batch_lane(pool, _batch(m)) for m in members)]

    async def close_ended(self, info: BatchInfo | None) -> None:
        """Delete the lanes of a batch none of whose items waits for a result any more (``close``),
        in the pools its record lists."""
        if info is None or batch_record.waits(info):
            return
        with unreachable():
            pools: Any = await self._r.hget(self.keys.batch(info.batch_id), "pools")
        await self.close(info.batch_id, info.created_at, batch_record.pool_list(pools))

    async def close(self, batch_id: str, created_at: float, pools: Iterable[str]) -> None:
        """Delete the batch's lanes in ``pools`` (its items all have results, or it is gone): the
        streams, their listings and their holds (the batch's creation time names its listings)."""
        member = lane_member(created_at, batch_id)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                for pool in pools:
                    pipe.zrem(self.keys.batch_lanes(pool), member)
                    pipe.hdel(self.keys.batch_holds(pool), member)
                    pipe.delete(self.keys.batch_lane(pool, batch_id))
                    pipe.zrem(self.keys.batch_lanes_open(pool), member)
                await pipe.execute()


def split_item_ref(ref: str) -> tuple[str, str]:
    """(batch id, "" for the shared stream; entry id) of a ``Lease.item_ref``."""
    entry_id, _, batch_id = ref.partition("@")
    return batch_id, entry_id


def _batch(member: Any) -> str:
    return lane_batch(member.decode() if isinstance(member, bytes) else str(member))


def _fields(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}
