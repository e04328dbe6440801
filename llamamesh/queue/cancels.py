"""A request's two cancel flags: its own (``Keys.cancel``, set by the gateway that relays it) and its
caller's (``Keys.called_off``, the Cancel RPC: every attempt of the request stops). Both are read
where a worker could start or go on with a job: when it is leased or reclaimed, and on every publish
of the worker that runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from llamamesh.queue import codec
from llamamesh.queue.cluster import is_cluster
from llamamesh.queue.keys import EVENT_FIELD, Keys, Retention
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import unreachable
from llamamesh.queue.replicas import Replicas
from llamamesh.queue.scripts import register
from llamamesh.types import GenerationRequest, JobEvent


class CancelFlags:
    def __init__(self, client: aioredis.Redis, keys: Keys, retention: Retention, replicas: Replicas) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self.replicas = replicas
        self._cluster = is_cluster(client)
        self._call_off = register(client, "call_off")

    async def cancel(self, request_id: str) -> None:
        """Set the request's flag, for as long as its events may live. Raises QueueUnavailable."""
        with unreachable():
            await self._r.set(self.keys.cancel(request_id), b"1", ex=self.retention.event_idle_s)

    async def call_off(self, caller_id: str) -> None:
        """Set the caller's flag (call_off.lua), on the replicas before it returns when they are
        waited for. Raises QueueUnavailable."""
        keys = [self.keys.attempts(caller_id), self.keys.called_off(caller_id)]
        with unreachable():
            replies = await self.replicas.script(self._r, self._call_off, keys, [self.retention.cancel_ahead_s])
        self.replicas.check(replies, "the cancel")

    def check(self, pipe: Any, requests: Sequence[GenerationRequest]) -> int:
        """Queue the commands that tell whether each request is cancelled; return how many replies
        they make. One MGET of both flags of every request (the flags are strings: SET ... 1); on a
        cluster, whose keys span slots, two EXISTS each."""
        if not requests:
            return 0
        if not self._cluster:
            k = self.keys
            pipe.mget([key for req in requests for key in (k.cancel(req.request_id), k.called_off(req.caller_id))])
            return 1
        for req in requests:
            pipe.exists(self.keys.cancel(req.request_id))
            pipe.exists(self.keys.called_off(req.caller_id))
        return 2 * len(requests)

    def cancelled(self, requests: Sequence[GenerationRequest], replies: Sequence[Any]) -> set[str]:
        """The request ids among ``requests`` that are cancelled, from ``check``'s replies."""
        if not requests:
            return set()
        flags = replies if self._cluster else replies[0]
        return {req.request_id for i, req in enumerate(requests) if flags[2 * i] or flags[2 * i + 1]}

    async def flagged(self, leases: list[Lease], reclaimed: bool = False) -> list[Lease]:
        """``leases`` with ``cancelled`` set from their flags; ``reclaimed``: also ``started`` and
        ``begun``, what a dead worker had published of each (its event stream). Raises QueueUnavailable."""
        if not leases:
            return []
        requests = [lease.request for lease in leases]
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                n_flags = self.check(pipe, requests)
                if reclaimed:
                    for req in requests:
                        pipe.xrange(self.keys.events(req.request_id))
                flags = await pipe.execute()
        gone = self.cancelled(requests, flags[:n_flags])
        begun = [_events(raw) for raw in flags[n_flags:]] if reclaimed else [()] * len(leases)
        return [
            dataclasses.replace(lease, cancelled=lease.request.request_id in gone, started=bool(b), begun=b)
            for lease, b in zip(leases, begun, strict=True)
        ]


def _events(raw: Any) -> tuple[JobEvent, ...]:
    """An event stream's entries (XRANGE's reply) as events."""
    return tuple(codec.decode_event(fields[EVENT_FIELD.encode()]) for _id, fields in raw or ())
