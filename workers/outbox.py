"""The worker's event writer (:class:`Outbox`): coalesces token deltas per engine step into one
publish, one Redis round trip for all in-flight requests, which also reports the requests cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable

import structlog

from llamamesh.backoff import Delays
from llamamesh.errors import QueueUnavailable
from llamamesh.queue.protocol import Lease, WorkQueue
from llamamesh.types import GenerationRequest, JobEvent

log = structlog.get_logger(__name__)


class Outbox:
    """Job tasks ``add`` events; one flusher task (started by ``start``, stopped by ``close``) drains
    everything pending in one ``WorkQueue.publish`` call, merging consecutive non-terminal events of
    the same request. At most every ``watch_interval_s`` the same call also reports which in-flight
    requests were cancelled; the outbox hands those to ``on_cancel``. Nothing is dropped when Redis
    is down: the batch is retried with backoff, in order.

    Any other failure of a publish is a bug the worker cannot write past (its streams would stall
    with their heartbeat still fresh): the flusher stops, releases every waiter of ``finish`` (their
    events can no longer be written) and tells ``on_fail``, and the worker leaves at once so that the
    gateways fail its streams over (workers/worker.py)."""

    def __init__(
        self,
        queue: WorkQueue,
        on_cancel: Callable[[str], Awaitable[None]],
        watch_interval_s: float = 0.1,
        on_fail: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._queue = queue
        self._on_cancel = on_cancel
        self._on_fail = on_fail
        # Set when the flusher stopped on an unexpected error: nothing more can be published.
        self.failed: BaseException | None = None
        self._watch_interval_s = watch_interval_s
        # request id -> (lease, events not yet published: one per sample run, merged where they
        # follow on), published in arrival order
        self._pending: dict[str, tuple[Lease, list[JobEvent]]] = {}
        self._order: list[str] = []
        self._terminal_done: dict[str, asyncio.Future[None]] = {}
        self._watch: dict[str, Lease] = {}
        self._cancel_seen: set[str] = set()
        self._last_watch = 0.0
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.publishes = 0
        # Jobs of data Redis lost (``forsake``): nothing more of theirs is written.
        self._forsaken: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox")

    async def close(self) -> None:
        """Flush what is pending (unless the flusher failed), then stop the flusher."""
        if self._task is None:
            return
        if self.failed is None:
            await self._flush_once()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    def watch(self, lease: Lease) -> None:
        """Check this in-flight request for cancellation on every publish."""
        self._watch[lease.request.request_id] = lease

    def add(self, lease: Lease, event: JobEvent) -> None:
        """Queue a non-terminal event, merged with the last one not yet published for the same
        request when it follows on (same sample)."""
        self._queue_event(lease, event)
        self._wake.set()

    def forsake(self, rids: Iterable[str]) -> None:
        """Write nothing more of these jobs (Redis came back without their data: their streams,
        records and leases are gone, and a request sent again under the same id must not see their
        events), until ``release``."""
        for rid in rids:
            self._forsaken.add(rid)
            self._pending.pop(rid, None)
            self._watch.pop(rid, None)
            if (fut := self._terminal_done.pop(rid, None)) is not None and not fut.done():
                fut.set_result(None)
        self._order = [rid for rid in self._order if rid not in self._forsaken]

    def release(self, rid: str) -> None:
        """The forsaken job ``rid`` ended: a new job under its id is written again."""
        self._forsaken.discard(rid)

    def _queue_event(self, lease: Lease, event: JobEvent) -> None:
        rid = lease.request.request_id
        if rid in self._forsaken:
            return
        prev = self._pending.get(rid)
        if prev is None:
            self._pending[rid] = (lease, [event])
            self._order.append(rid)
        elif prev[1][-1].follows_on(event):
            prev[1][-1] = prev[1][-1].then(event)
        else:
            prev[1].append(event)

    async def finish(self, lease: Lease, event: JobEvent) -> None:
        """Queue the terminal event (merged with an unpublished delta it follows on) and wait until
        it is written and the job acked (a hand-back, ``JobEvent.handed_back``: written, not acked).
        Cancelling the waiter does not withdraw the event. Returns at once if the flusher failed: the
        event cannot be written, and the worker is leaving."""
        rid = lease.request.request_id
        if self.failed is not None or rid in self._forsaken:
            return
        self._queue_event(lease, event)
        done = self._terminal_done[rid] = asyncio.get_running_loop().create_future()
        self._wake.set()
        await asyncio.shield(done)

    async def _run(self) -> None:
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._watch_interval_s if self._watch else None)
                # Let every job task that is ready this iteration add its delta first.
                await asyncio.sleep(0)
                await self._flush_once()
        except Exception as exc:  # not QueueUnavailable (retried inside): a bug; CancelledError passes
            log.error("outbox_failed", error=repr(exc), exc_info=True)
            self.failed = exc
            for fut in self._terminal_done.values():
                if not fut.done():
                    fut.set_result(None)
            self._terminal_done.clear()
            if self._on_fail is not None:
                self._on_fail(exc)

    async def _flush_once(self) -> None:
        async with self._lock:
            await self._flush_locked()

    async def _flush_locked(self) -> None:
        self._wake.clear()
        order, self._order = self._order, []
        batch: list[tuple[Lease, JobEvent]] = []
        for rid in order:
            lease, events = self._pending.pop(rid)
            batch += ((lease, ev) for ev in events)
        # Cancellation is checked at most every watch_interval_s, not on every step: at hundreds of
        # requests in flight an EXISTS per request per step would triple the commands per publish.
        now = time.monotonic()
        watch: list[GenerationRequest] = []
        if now - self._last_watch >= self._watch_interval_s:
            watch = [lease.request for rid, lease in self._watch.items() if rid not in self._cancel_seen]
            self._last_watch = now
        if not batch and not watch:
            return
        delays = Delays()
        while True:
            try:
                cancelled = await self._queue.publish(batch, watch)
                break
            except QueueUnavailable:
                # Published again whole: what the failed try applied is written twice, and the
                # reader drops the repeats by index (services/cursor.py).
                log.warning("events_publish_failed", pending=len(batch), retry_in_s=round(await delays.wait(), 3))
        self.publishes += 1
        for lease, event in batch:
            rid = lease.request.request_id
            if event.last_of_worker:
                self._watch.pop(rid, None)
                self._cancel_seen.discard(rid)
                fut = self._terminal_done.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
        for rid in cancelled:
            if rid in self._watch and rid not in self._cancel_seen:
                self._cancel_seen.add(rid)
                await self._on_cancel(rid)
