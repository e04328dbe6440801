"""A request's events: one stream per request (``Keys.events``), written by the worker that runs it
(``publish``: every request's events of an engine step in one round trip) and read by its gateway
through the gateway's one follower (follow.py), which merges what queued up unread.

An event stream lives ``Retention.event_s`` after its terminal event, and ``Retention.event_idle_s``
without one: its worker renews that while it publishes, so a long request keeps its stream and an
abandoned one expires. A terminal event also acks the job's work-stream entry.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from llamamesh.errors import QueueUnavailable
from llamamesh.queue import codec, groups
from llamamesh.queue.attempts import AttemptsLog
from llamamesh.queue.cancels import CancelFlags
from llamamesh.queue.cluster import is_cluster
from llamamesh.queue.follow import EventFollower, Follower, Item
from llamamesh.queue.keys import EVENT_FIELD, Keys, Retention
from llamamesh.queue.protocol import Lease
from llamamesh.queue.redisio import call_scripts, unreachable
from llamamesh.queue.scripts import source
from llamamesh.types import GenerationRequest, JobEvent


class EventStreams:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        retention: Retention,
        flags: CancelFlags,
        attempts: AttemptsLog,
        clock: Callable[[], float],
        block_ms: int,
        outage_grace_s: float,
    ) -> None:
        self._r = client
        self.keys = keys
        self.retention = retention
        self._flags = flags
        self._attempts = attempts
        self._clock = clock
        self._cluster = is_cluster(client)
        self._block_ms = block_ms
        self._outage_grace_s = outage_grace_s
        self._follower: EventFollower | None = None
        # request id -> when its event stream's idle TTL is due for renewal (clock seconds); an
        # entry leaves with the request's terminal event, or once overdue by a whole TTL (a job
        # given up without one), looked for every ``renew_fraction`` of the TTL.
        self.renew_at: dict[str, float] = {}
        self._forget_at = 0.0

    # ---- the gateway's side: following -------------------------------------
    async def events(self, request_id: str, after: str = "0-0") -> AsyncGenerator[tuple[str, JobEvent], None]:
        async for item in self.followed(request_id, after, None):
            if item is not None:
                yield item

    async def followed(
        self, request_id: str, after: str, idle_s: float | None
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        """The request's events after ``after`` through the follower, a run of those queued up unread
        as one (``_caught_up``), ending after the terminal one; with ``idle_s``, None each time that
        passes without one. Raises QueueUnavailable."""
        if self._follower is None:
            self._follower = EventFollower(
                self._r, self.keys, self._block_ms, self.retention.event_idle_s, self._outage_grace_s
            )
        sub = await self._follower.follow(self.keys.events(request_id), after)
        held: Item | None = None
        try:
            while True:
                if held is not None:
                    item, held = held, None
                elif idle_s is None:
                    item = await sub.queue.get()
                else:
                    got = await sub.queue.get_within(idle_s)
                    if got is None:
                        yield None
                        continue
                    item = got
                entry_id, event, held = self._caught_up(sub, item)
                yield entry_id, event
                if event.terminal:
                    return
        finally:
            self._follower.unfollow(sub)

    def _caught_up(self, sub: Follower, item: Item) -> tuple[str, JobEvent, Item | None]:
        """``item``'s event joined with those that queued up after it and follow on: a reader that
        fell behind catches up instead of lagging further (as vLLM's output collector merges
        deltas). Returns the last one's id, the joined event, and the item that stopped the run (to
        deliver next) if any. A failure is never merged: the tokens before it are delivered first."""
        entry_id, event = _decoded(item)
        run = [event]
        while not run[-1].terminal and not sub.queue.empty():
            item = sub.queue.get_nowait()
            if isinstance(item, BaseException):
                return entry_id, JobEvent.joined(run), item
            next_id, later = _decoded(item)
            if later.failed is not None or not run[-1].follows_on(later):
                # A failure, or an event that does not follow on (a repeat the worker's retried
                # publish wrote, or a gap): delivered on its own, for the relay's stream invariant
                # (services/cursor.py) to judge.
                return entry_id, JobEvent.joined(run), item
            entry_id = next_id
            run.append(later)
        return entry_id, JobEvent.joined(run), None

    async def end(self, request_id: str, event: JobEvent) -> None:
        key = self.keys.events(request_id)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.xadd(key, {EVENT_FIELD: codec.encode_event(event)})
                pipe.expire(key, self.retention.event_s)
                await pipe.execute()

    async def read_events(self, request_id: str) -> list[tuple[str, JobEvent]]:
        with unreachable():
            raw: Any = await self._r.xrange(self.keys.events(request_id))
        return [(i.decode(), codec.decode_event(f[EVENT_FIELD.encode()])) for i, f in raw]

    async def last_event(self, request_id: str) -> tuple[int, JobEvent | None]:
        key = self.keys.events(request_id)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.xlen(key)
                pipe.xrevrange(key, count=1)
                n, last = await pipe.execute()
        return int(n), codec.decode_event(last[0][1][EVENT_FIELD.encode()]) if last else None

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()
            self._follower = None

    # ---- the worker's side: publishing --------------------------------------
    async def publish(self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]) -> set[str]:
        """Also (re)sets a stream's idle TTL (``_ttls``), so that a long request keeps its stream while
        it runs; renewals count only once the pipeline went through. A single server gets one script
        for all the step's events (``_publish_one_script``); a cluster one command per event (this)."""
        if not self._cluster:
            return await self._publish_one_script(events, watch)
        now = self._clock()
        ttls, renewed = self._ttls(events, now)
        # On a cluster (its pipelines refuse scripts) the attempts' scripts run after the pipeline.
        ended: list[tuple[Any, list[str], list[Any]]] = []
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                for (lease, event), (ttl, record) in zip(events, ttls, strict=True):
                    req = lease.request
                    key = self.keys.events(req.request_id)
                    pipe.xadd(key, {EVENT_FIELD: codec.encode_event(event)})
                    if ttl:
                        pipe.expire(key, ttl)
                    if record:
                        self._attempts.renew(pipe, req.caller_id)
                    if event.terminal:
                        ended.append(self._attempts.ended(req, ttl))
                        groups.ack(pipe, self.keys.work(lease.pool, lease.tenant, lease.partition), lease.entry_id)
                n_flags = self._flags.check(pipe, watch)
                replies = await pipe.execute()
            await call_scripts(self._r, ended)
        self._renewed(now, renewed, [lease.request.request_id for lease, event in events if event.terminal])
        return self._flags.cancelled(watch, replies[len(replies) - n_flags :])

    async def _publish_one_script(
        self, events: Sequence[tuple[Lease, JobEvent]], watch: Sequence[GenerationRequest]
    ) -> set[str]:
        """``publish`` on a single server: every event's XADD and TTLs in one append_events.lua,
        then the terminal events' acks and the renewals of callers' records, then the cancel flags."""
        now = self._clock()
        ttls, renewed = self._ttls(events, now)
        keys: list[str] = []
        args: list[Any] = [EVENT_FIELD]
        ended: list[Lease] = []  # acked after the script wrote their terminal events
        records: list[str] = []  # callers whose attempts records' TTL is renewed
        for (lease, event), (ttl, record) in zip(events, ttls, strict=True):
            req = lease.request
            keys.append(self.keys.events(req.request_id))
            args += [codec.encode_event(event), ttl, req.request_id if event.terminal else ""]
            if event.terminal:
                keys.append(self.keys.attempts(req.caller_id))
                ended.append(lease)
            if record:
                records.append(req.caller_id)
        with unreachable():
            async with self._r.pipeline(transaction=False) as pipe:
                if keys:
                    pipe.eval(source("append_events"), len(keys), *keys, *args)
                for lease in ended:
                    groups.ack(pipe, self.keys.work(lease.pool, lease.tenant, lease.partition), lease.entry_id)
                for caller_id in records:
                    self._attempts.renew(pipe, caller_id)
                n_flags = self._flags.check(pipe, watch)
                replies = await pipe.execute() if len(pipe) else []
        self._renewed(now, renewed, [lease.request.request_id for lease in ended])
        return self._flags.cancelled(watch, replies[len(replies) - n_flags :])

    def _ttls(self, events: Sequence[tuple[Lease, JobEvent]], now: float) -> tuple[list[tuple[int, bool]], set[str]]:
        """Per event: the TTL its stream gets now (0: none) and whether its caller's attempts record
        is renewed with it; and the requests whose idle TTL this renews. A terminal event gives its
        stream the ended TTL; the first event of a request creates its stream and bounds its life in
        case no terminal follows, and later ones push that bound on at most every quarter of it."""
        renewed: set[str] = set()
        out: list[tuple[int, bool]] = []
        for lease, event in events:
            rid = lease.request.request_id
            if event.terminal:
                out.append((self.retention.event_s, False))
            elif rid not in renewed and now >= self.renew_at.get(rid, now):
                out.append((self.retention.event_idle_s, rid in self.renew_at))  # a renewal: the record too
                renewed.add(rid)
            else:
                out.append((0, False))
        return out, renewed

    def _renewed(self, now: float, renewed: set[str], ended: Sequence[str]) -> None:
        """Note the streams whose idle TTL was just renewed and forget the requests that ended. An
        entry overdue by a whole TTL belongs to a job this process gave up without a terminal
        event (its stream expired): those go too, looked for every ``renew_fraction`` of the TTL."""
        ttl = self.retention.event_idle_s
        every = ttl * self.retention.renew_fraction
        for rid in renewed:
            self.renew_at[rid] = now + every
        for rid in ended:
            self.renew_at.pop(rid, None)
        if now >= self._forget_at:
            self.renew_at = {rid: at for rid, at in self.renew_at.items() if at + ttl > now}
            self._forget_at = now + every


def _decoded(item: Item) -> tuple[str, JobEvent]:
    if isinstance(item, BaseException):
        raise QueueUnavailable("the queue is unreachable") from item
    entry_id, fields = item
    return entry_id, codec.decode_event(fields[EVENT_FIELD.encode()])
