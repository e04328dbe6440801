"""A batch's creation on Redis: stored whole, or not at all. Only a sealed batch (every item queued)
is reported accepted; a submission that fails part-way drops what it wrote, or leaves the batch
unsealed for its retry to finish or the gateways' sweep to drop (``drop_unsealed``). Every item of
an accepted batch is queued, and ends with exactly one result (an item queued twice runs twice; its
result is recorded once). Redis errors become QueueUnavailable (QueueOutOfMemory when Redis is full).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llamamesh.errors import AlreadyExists, QueueUnavailable
from llamamesh.queue import batch_record, codec, groups
from llamamesh.queue.affinity import grouped
from llamamesh.queue.keys import Keys, Retention
from llamamesh.queue.lanes import BatchLanes
from llamamesh.queue.redisio import raised, unreachable
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.scripts import register
from llamamesh.types import BatchInfo, BatchState, GenerationRequest, public_id

# Items are queued in pipelines of about this many bytes, at most CHUNK_ITEMS items.
CHUNK_BYTES = 64 * 1024
CHUNK_ITEMS = 500


class BatchIntake:
    """Creates batches whole (see the module's docstring); ``RedisBatches`` delegates to it."""

    def __init__(self, client: aioredis.Redis, keys: Keys, retention: Retention, replicas: Replicas) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self._replicas = replicas
        self._create = register(client, "create_batch")
        self._seal = register(client, "seal_batch")
        self._drop = register(client, "drop_batch")
        self._lanes = BatchLanes(client, keys)

    def batch_keys(self, batch_id: str) -> list[str]:
        """Every key of the batch's own slot, its record first."""
        k = self.keys
        return [
            k.batch(batch_id),
            k.batch_done(batch_id),
            k.batch_results(batch_id),
            k.batch_ids(batch_id),
            k.batch_started(batch_id),
            k.batch_queued(batch_id),
        ]

    async def create(self, info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]) -> bool:
        """Store the batch and queue every item (``(pool, request)`` each) that is not queued yet;
        True if it is new. AlreadyExists when the id names a batch with another fingerprint. On any
        failure what this call wrote is dropped, if Redis lets it, and the error raised.

        In steps, since its items go to the batch's lanes (each pool's slot) and its record
        to its own (``{b:<id>}``):

        1. its id on the ``batches_unsealed`` list, due ``Retention.unsealed_s`` from now;
        2. its record (create_batch.lua, one script: two submissions of one id never see half a
           record), which also says when a submission last worked on it (``touched``);
        3. its owner's list, the sweep's sets, its item ids;
        4. every item not queued yet onto the batch's lane of its pool (each prefix key's items
           together), each reported on its own, and the ids of those queued into the batch's
           ``queued`` set; each lane is listed for leasing after its entries;
        5. seal_batch.lua: once every item is in ``queued``, the record is marked ``enqueued``;
           if the batch ended meanwhile (cancelled), its lanes are deleted again.

        A failure (Redis refuses writes when it is full, or stops answering) drops what it wrote
        (drop_batch.lua): items already queued then find no batch and are skipped. When even that
        fails, the batch stays unsealed: a retry of the same submission (same id and items) queues
        only the missing items and seals it; without one, the sweep drops it once nobody worked on
        it for ``Retention.unsealed_s``."""
        meta = self.keys.batch(info.batch_id)
        args: list[Any] = [time.time(), *(x for kv in _record(info, fingerprint, items).items() for x in kv)]
        try:
            with unreachable():
                due = time.time() + self.retention.unsealed_s
                await self._r.zadd(self.keys.batches_unsealed(), {info.batch_id: due})
                stored: Any = await self._create(keys=[meta], args=args)
        except QueueUnavailable:
            if await self._sealed_as(info.batch_id, fingerprint):  # a full Redis refuses the script, not the read
                return False
            raise
        created = stored == 1
        if not created:
            if stored[0] is None or stored[0].decode() != fingerprint:
                raise AlreadyExists(
                    f"batch id {public_id(info.batch_id)!r} names another batch (other items); resubmit it "
                    "unchanged, or use a new id"
                )
            if stored[1] is not None:
                await self._confirm(meta)
                return False
            # Unsealed: finished with the first submission's times, not this retry's.
            info = replace(info, created_at=float(stored[2]), expires_at=float(stored[3]))
        try:
            await self._enqueue(info, items, created)
        except QueueUnavailable:
            await self._drop_after_failure(info)
            raise
        return created

    async def _sealed_as(self, batch_id: str, fingerprint: str) -> bool:
        """Whether the batch is stored and sealed with this fingerprint (a read: Redis may be full)."""
        with unreachable():
            got: Any = await self._r.hmget(self.keys.batch(batch_id), "fingerprint", "enqueued")
        return got[0] is not None and got[0].decode() == fingerprint and got[1] is not None

    async def _confirm(self, meta: str) -> None:
        """A stored batch asked for again: with replicas, a write of this connection's for WAIT to
        cover the stored one before the caller is told."""
        if self._replicas.count:
            with unreachable():
                async with self._r.pipeline(transaction=False) as pipe:
                    pipe.hset(meta, "enqueued", 1)
                    self._replicas.wait(pipe)
                    self._replicas.check(await pipe.execute(), "the batch")

    async def _enqueue(
        self,
        info: BatchInfo,
        items: Sequence[tuple[str, GenerationRequest]],
        created: bool,
    ) -> None:
        """Steps 3-5 for the items not queued yet. Raises QueueUnavailable unless the batch is sealed."""
        bid = info.batch_id
        with unreachable():
            if created:
                done: set[str] = set()
            else:
                members: Any = await self._r.smembers(self.keys.batch_queued(bid))
                done = {m.decode() for m in members}
            async with self._r.pipeline(transaction=False) as pipe:
                # On its owner's list, in the sweep's open set, and gone Retention.batch_s after it ends at the
                # earliest (ZADD again, from a retry, is harmless).
                pipe.zadd(self.keys.batches(info.owner), {bid: info.created_at})
                pipe.zadd(self.keys.batches_open(), {bid: info.expires_at})
                kept_until = time.time() + self.retention.batch_s
                pipe.zadd(self.keys.batches_kept(), {json.dumps([info.owner, bid]): kept_until})
                ids = [request.custom_id for _pool, request in items]
                for i in range(0, len(ids), 1000):
                    pipe.sadd(self.keys.batch_ids(bid), *ids[i : i + 1000])
                await pipe.execute()
            todo = [(pool, request) for pool, request in items if request.custom_id not in done]
            await self._queue_items(info, grouped(todo))
            sealed = int(await self._seal(keys=[self.keys.batch(bid), self.keys.batch_queued(bid)]))
            if sealed != 1:
                raise QueueUnavailable(f"batch {public_id(bid)!r} was dropped while being written; submit it again")
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.batches_unsealed(), bid)
                self._replicas.wait(pipe)  # the record, every item and the seal
                replies = await pipe.execute()
        self._replicas.check(replies, "the batch")
        if todo:  # a batch that ended meanwhile (cancelled) had its lanes deleted before these items came
            await self._lanes.close_ended(await batch_record.read(self._r, self.keys, bid))

    async def _queue_items(self, info: BatchInfo, todo: Sequence[tuple[str, GenerationRequest]]) -> None:
        """Step 4, in pipelines of at most ``CHUNK_BYTES`` (Redis counts a pipeline's bytes against
        its maxmemory while it reads them, so one pipeline of a whole large batch would be refused
        whole by a Redis near its limit). Raises at the first refusal: no chunk is sent after it.
        Each lane and its consumer group are made first, so that its entries are pending from the
        moment they are leased (a reclaim, a touch and the sweep find them)."""
        for pool in dict.fromkeys(pool for pool, _request in todo):
            await groups.create_group(self._r, self.keys.batch_lane(pool, info.batch_id))
        chunk: list[tuple[str, GenerationRequest, bytes]] = []
        size = 0
        for n, (pool, request) in enumerate(todo, 1):
            job = codec.encode_job(request)
            chunk.append((pool, request, job))
            size += len(job)
            if size >= CHUNK_BYTES or len(chunk) >= CHUNK_ITEMS or n == len(todo):
                await self._queue_chunk(info, chunk)
                chunk, size = [], 0

    async def _queue_chunk(self, info: BatchInfo, chunk: Sequence[tuple[str, GenerationRequest, bytes]]) -> None:
        async with self._r.pipeline(transaction=False) as pipe:
            self._lanes.queue(pipe, info, chunk)
            replies = await pipe.execute(raise_on_error=False)
        queued = []
        for (_pool, request, _job), reply in zip(chunk, replies, strict=False):  # the XADDs' replies come first
            if not isinstance(reply, RedisError):
                queued.append(request.custom_id)
        if queued:
            await self._r.sadd(self.keys.batch_queued(info.batch_id), *queued)
        refused = next((reply for reply in replies if isinstance(reply, RedisError)), None)
        if refused is not None:
            raise raised(refused)

    async def _drop_after_failure(self, info: BatchInfo) -> None:
        """Drop what a failed submission wrote, the lanes it queued included (deletions: a full
        Redis takes them). Nothing if Redis refuses: the batch then stays unsealed, for a retry to
        finish or the sweep to drop (its queued items then find no batch, and are skipped)."""
        try:
            if await self.drop(info.batch_id, 0.0) != 1:
                return
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.batches(info.owner), info.batch_id)
                pipe.zrem(self.keys.batches_unsealed(), info.batch_id)
                await pipe.execute()
        except (QueueUnavailable, RedisError):
            return

    async def drop(self, batch_id: str, idle_s: float) -> int:
        """Drop the batch unless it is sealed or a submission touched it within ``idle_s``, and then
        its lanes; drop_batch.lua's reply (1: dropped)."""
        with unreachable():
            meta: Any = await self._r.hmget(self.keys.batch(batch_id), "created_at", "pools")
            outcome = int(await self._drop(keys=self.batch_keys(batch_id), args=[time.time(), idle_s]))
        if outcome == 1 and meta[0] is not None:
            await self._lanes.close(batch_id, float(meta[0]), batch_record.pool_list(meta[1]))
        return outcome

    async def drop_unsealed(self, limit: int = 100) -> int:
        """The sweep's part: drop up to ``limit`` batches left unsealed for ``Retention.unsealed_s`` (their
        submissions failed and were not retried); returns how many it dropped."""
        key = self.keys.batches_unsealed()
        with unreachable():
            due: Any = await self._r.zrangebyscore(key, "-inf", time.time(), start=0, num=limit)
        dropped = 0
        for raw in due:
            bid = raw.decode()
            outcome = await self.drop(bid, self.retention.unsealed_s)
            with unreachable():
                if outcome == -1:  # a submission is at it: look again later
                    await self._r.zadd(key, {raw: time.time() + self.retention.unsealed_s})
                    continue
                await self._r.zrem(key, raw)
            dropped += outcome == 1
        return dropped


def _record(info: BatchInfo, fingerprint: str, items: Sequence[tuple[str, GenerationRequest]]) -> dict[str, Any]:
    """A new batch's record (batch_record.py reads it), as create_batch.lua stores it."""
    return {
        "id": info.batch_id,
        "state": BatchState.IN_PROGRESS.value,
        "owner": info.owner,
        "model": info.model,
        "total": info.total,
        "completion_window_s": info.completion_window_s,
        "created_at": info.created_at,
        "expires_at": info.expires_at,
        "fingerprint": fingerprint,
        "metadata": json.dumps(dict(info.metadata)),
        "t:validating": info.created_at,
        "t:in_progress": time.time(),
        "pools": ",".join(sorted({pool for pool, _request in items})),
        "succeeded": 0,
        "errored": 0,
        "cancelled": 0,
        "expired": 0,
    }
