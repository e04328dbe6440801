"""Durable batches on Redis.

- A batch's record is a hash (``keys.batch``): state, owner, counts, the time it entered each
  state (``t:<state>``), its deadline; ``keys.batches(owner)`` lists an owner's batches.
- Its items are jobs on the pool's *batch* work stream (``keys.batch_items``), a second stream
  the pool's workers read through the same consumer group name, below the interactive one.
- A result is recorded by one Lua script (``_RECORD``) that writes it only if the item has none
  yet (``keys.batch_done``, custom_id -> status), appends it to ``keys.batch_results``, counts it
  and, with the last item, ends the batch; then the item is acked. A worker that dies leaves its
  items pending: another worker claims them after ``claim_idle_ms`` (``reclaim``), and a second
  result for the same custom_id is dropped: execution is at least once, the result exactly once.
- Counts never drift: ``processing`` is ``total`` minus the recorded ones.

Redis errors become ``QueueUnavailable`` here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from llamamesh.errors import InvalidRequest, QueueUnavailable
from llamamesh.queue import codec
from llamamesh.queue.keys import JOB_FIELD, RESULT_FIELD, WORKER_GROUP, Keys
from llamamesh.queue.protocol import Lease
from llamamesh.queue.streams import create_group
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, ItemResult

COUNTS = ("succeeded", "errored", "cancelled", "expired")

# KEYS: meta, done, results. ARGV: custom_id, status, encoded result, now, retention_s.
# Returns 1 (recorded), 0 (the item had a result already), -1 (no such batch: it was purged).
_RECORD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[3], '*', 'r', ARGV[3])
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
local f = redis.call('HMGET', KEYS[1], 'total', 'succeeded', 'errored', 'cancelled', 'expired', 'state')
local n = (tonumber(f[2]) or 0) + (tonumber(f[3]) or 0) + (tonumber(f[4]) or 0) + (tonumber(f[5]) or 0)
if n >= tonumber(f[1]) and (f[6] == 'in_progress' or f[6] == 'cancelling') then
  local final = 'completed'
  if f[6] == 'cancelling' then final = 'cancelled' elseif (tonumber(f[5]) or 0) > 0 then final = 'expired' end
  redis.call('HSET', KEYS[1], 't:finalizing', ARGV[4])
  redis.call('HSET', KEYS[1], 'state', final, 't:' .. final, ARGV[4],
             'results_expire_at', tonumber(ARGV[4]) + tonumber(ARGV[5]))
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
end
return 1
"""

# KEYS: meta. ARGV: the record, field value field value ... Returns 1 (created), or the stored
# {fingerprint, enqueued} of an existing batch.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HMGET', KEYS[1], 'fingerprint', 'enqueued') end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS: meta. ARGV: now. Returns the state after the call ('' if there is no such batch).
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return '' end
if state == 'in_progress' or state == 'validating' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 't:cancelling', ARGV[1])
  return 'cancelling'
end
return state
"""


def _float(raw: Any, default: float = 0.0) -> float:
    return float(raw) if raw is not None else default


def info_of(raw: dict[bytes, bytes]) -> BatchInfo:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return BatchInfo(
        batch_id=f["id"],
        state=BatchState(f["state"]),
        owner=f.get("owner", ""),
        model=f.get("model", ""),
        total=int(f["total"]),
        completion_window_s=int(f.get("completion_window_s", "0")),
        created_at=_float(f.get("created_at")),
        expires_at=_float(f.get("expires_at")),
        **{c: int(f.get(c, "0")) for c in COUNTS},  # type: ignore[arg-type]
        times=MappingProxyType({k[2:]: float(v) for k, v in f.items() if k.startswith("t:")}),
        results_expire_at=_float(f.get("results_expire_at")),
        metadata=MappingProxyType(json.loads(f.get("metadata", "{}"))),
    )


class RedisBatches:
    """The batch store, both faces: the gateway's (create, get, owned, cancel, results) and the
    worker's (lease_items, record, touch, reclaim)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, retention_s: int) -> None:
        self._r = client
        self.keys = keys
        self.retention_s = retention_s
        self._record = client.register_script(_RECORD)
        self._cancel = client.register_script(_CANCEL)
        self._create = client.register_script(_CREATE)

    # ---- gateway side -------------------------------------------------------
    async def create(
        self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]
    ) -> tuple[BatchInfo, bool]:
        """Store the batch and queue its items (``(pool, request)`` each); returns it and whether it
        is new. The same batch_id again with the same fingerprint returns the stored batch (its items
        queued again only if the first submission died before queueing all of them); with another
        fingerprint, InvalidRequest on batch_id."""
        meta = self.keys.batch(info.batch_id)
        record = {
            "id": info.batch_id, "state": BatchState.IN_PROGRESS.value, "owner": info.owner, "model": info.model,
            "total": info.total, "completion_window_s": info.completion_window_s, "created_at": info.created_at,
            "expires_at": info.expires_at, "fingerprint": fingerprint, "metadata": json.dumps(dict(info.metadata)),
            "t:validating": info.created_at, "t:in_progress": time.time(),
            **dict.fromkeys(COUNTS, 0),
        }  # fmt: skip
        flat = [str(x) for kv in record.items() for x in kv]
        try:
            # One script: two concurrent submissions of one id never see a half-written record.
            stored: Any = await self._create(keys=[meta], args=flat)
            created = stored == 1
            if created:
                await self._r.zadd(self.keys.batches(info.owner), {info.batch_id: info.created_at})
            else:
                if stored[0] is None or stored[0].decode() != fingerprint:
                    raise InvalidRequest.field("batch_id", f"batch {info.batch_id!r} exists with other items")
                if stored[1] is not None:
                    return await self._require(info.batch_id), False
            async with self._r.pipeline(transaction=False) as pipe:
                for pool, request in items:
                    pipe.xadd(self.keys.batch_items(pool), {JOB_FIELD: codec.encode_job(request)})
                pipe.hset(meta, "enqueued", 1)
                await pipe.execute()
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return await self._require(info.batch_id), bool(created)

    async def _require(self, batch_id: str) -> BatchInfo:
        got = await self.get(batch_id)
        if got is None:
            raise QueueUnavailable(f"batch {batch_id!r} vanished while being written")
        return got

    async def get(self, batch_id: str) -> BatchInfo | None:
        try:
            raw: Any = await self._r.hgetall(self.keys.batch(batch_id))
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return info_of(raw) if raw and b"state" in raw else None

    async def owned(self, owner: str, limit: int, before: float | None) -> list[BatchInfo]:
        """The owner's batches created before ``before`` (None: all), newest first, at most ``limit``."""
        key = self.keys.batches(owner)
        try:
            ids: Any = await self._r.zrevrangebyscore(
                key, f"({before}" if before is not None else "+inf", "-inf", start=0, num=limit
            )
            out = []
            for raw_id in ids:
                info = await self.get(raw_id.decode())
                if info is None:  # purged after its retention
                    await self._r.zrem(key, raw_id)
                else:
                    out.append(info)
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return out

    async def cancel(self, batch_id: str) -> BatchInfo | None:
        """Move an unfinished batch to cancelling (its queued items end cancelled as workers reach
        them, running ones finish); an ended one is returned as it is. None if unknown."""
        try:
            state = await self._cancel(keys=[self.keys.batch(batch_id)], args=[time.time()])
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return await self.get(batch_id) if state else None

    async def results(self, batch_id: str, after: str, block_ms: int | None) -> list[tuple[str, ItemResult]]:
        """Results after cursor ``after`` ("0-0": from the first), waiting up to ``block_ms`` for one."""
        try:
            reply: Any = await self._r.xread({self.keys.batch_results(batch_id): after}, count=500, block=block_ms)
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return [
            (entry_id.decode(), codec.decode_result(fields[RESULT_FIELD.encode()]))
            for _stream, entries in reply or ()
            for entry_id, fields in entries
        ]

    # ---- worker side --------------------------------------------------------
    async def join(self, pool: str) -> None:
        await create_group(self._r, self.keys.batch_items(pool))

    async def lease_items(self, pool: str, consumer: str, count: int, block_ms: int | None) -> list[Lease]:
        """Take up to ``count`` new batch items (waiting at most ``block_ms``; None: not at all). An
        item of a cancelled batch comes with ``cancelled``, one past its batch's deadline with
        ``expired``: the worker records those without running them."""
        try:
            reply: Any = await self._r.xreadgroup(
                WORKER_GROUP, consumer, {self.keys.batch_items(pool): ">"}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                await self.join(pool)
                return []
            raise QueueUnavailable(f"cannot read the batch stream: {exc}") from exc
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return await self._leases(pool, [e for _s, es in reply or () for e in es])

    async def reclaim(self, pool: str, consumer: str, min_idle_ms: int, count: int) -> list[Lease]:
        """Take over items another worker leased and has not touched for ``min_idle_ms`` (it died)."""
        try:
            reply: Any = await self._r.xautoclaim(
                self.keys.batch_items(pool), WORKER_GROUP, consumer, min_idle_ms, "0-0", count=count
            )
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                return []
            raise QueueUnavailable(f"cannot claim from the batch stream: {exc}") from exc
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        return await self._leases(pool, [e for e in reply[1] if e and e[1]])

    async def touch(self, pool: str, consumer: str, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of items this worker is still running, so nobody reclaims them."""
        if not entry_ids:
            return
        try:
            await self._r.xclaim(self.keys.batch_items(pool), WORKER_GROUP, consumer, 0, list(entry_ids), justid=True)
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc

    async def _leases(self, pool: str, entries: list[Any]) -> list[Lease]:
        stream = self.keys.batch_items(pool)
        decoded: list[tuple[str, GenerationRequest]] = []
        bad: list[str] = []
        for entry_id, fields in entries:
            eid = entry_id.decode()
            try:
                decoded.append((eid, codec.decode_job(fields[JOB_FIELD.encode()])))
            except (InvalidRequest, KeyError):
                bad.append(eid)
        batch_ids = sorted({req.batch_id for _e, req in decoded})
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for bid in batch_ids:
                    pipe.hmget(self.keys.batch(bid), ["state", "expires_at"])
                if bad:
                    pipe.xack(stream, WORKER_GROUP, *bad)
                    pipe.xdel(stream, *bad)
                replies = await pipe.execute()
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        now = time.time()
        gate = {}
        for bid, (state, expires_at) in zip(batch_ids, replies[: len(batch_ids)], strict=True):
            state = state.decode() if state else ""
            gate[bid] = (state in ("", "cancelling", "cancelled"), bool(expires_at) and now > float(expires_at))
        return [
            Lease(pool=pool, entry_id=eid, request=req, cancelled=gate[req.batch_id][0], expired=gate[req.batch_id][1])
            for eid, req in decoded
        ]

    async def discard(self, lease: Lease) -> None:
        """Ack and drop a leased item without a result (a second copy of an item already running)."""
        stream = self.keys.batch_items(lease.pool)
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.xack(stream, WORKER_GROUP, lease.entry_id)
                pipe.xdel(stream, lease.entry_id)
                await pipe.execute()
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc

    async def record(self, lease: Lease, result: ItemResult) -> bool:
        """Record the item's one result (False: it had one already, or its batch is gone), then ack it."""
        req = lease.request
        bid = req.batch_id
        keys = [self.keys.batch(bid), self.keys.batch_done(bid), self.keys.batch_results(bid)]
        try:
            done = await self._record(
                keys=keys,
                args=[req.custom_id, result.status.value, codec.encode_result(result), time.time(), self.retention_s],
            )
        except RedisError as exc:
            raise QueueUnavailable("the queue is unreachable") from exc
        await self.discard(lease)
        return int(done) == 1


