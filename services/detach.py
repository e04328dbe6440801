"""What happens to a request's job when its caller leaves: a resumable request is detached (a timer
cancels it after the re-attach grace unless someone attaches meanwhile or still reads it), any
other is cancelled.

``DetachTimers`` owns the timers of one relay and cancels them at its close; ``cancel_quietly``
cancels a job when nobody waits for the answer (Redis being out is logged, not raised).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from llamamesh import errors, metrics, tracing
from llamamesh.queue.protocol import RelayQueue

log = structlog.get_logger(__name__)


async def cancel_quietly(queue: RelayQueue, job_id: str) -> None:
    """Cancel job ``job_id``; while Redis is out, log it and go on (its worker stops at the deadline)."""
    try:
        await queue.cancel(job_id)
    except errors.QueueUnavailable:
        log.warning("cancel_failed", request_id=job_id)


class DetachTimers:
    """The detach timers of one relay's resumable requests whose caller went away."""

    def __init__(self, queue: RelayQueue, grace_s: float) -> None:
        self._queue = queue
        self._grace_s = grace_s
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, caller_id: str, job_id: str) -> None:
        """Request ``caller_id`` (its running job ``job_id``) lost its caller: cancel the job after
        the re-attach grace unless someone attached meanwhile (the count of attaches moved)."""
        try:
            seen = await self._queue.attach_count(caller_id)
        except errors.QueueUnavailable:
            seen = -1
        log.info("request_detached", request_id=caller_id, grace_s=self._grace_s)
        task = asyncio.create_task(self._expire(caller_id, job_id, seen), name=f"detached-{caller_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self, caller_id: str, job_id: str, gone: bool, resumable: bool) -> None:
        """A caller's stream ended before its job ``job_id`` did: a resumable request whose caller
        went away (``gone``) is detached (it may Attach again); otherwise (disconnect, deadline or a
        failed read) the worker must stop generating."""
        if resumable and gone:
            tracing.event("detached", job=job_id)
            await asyncio.shield(self.start(caller_id, job_id))
            return
        gone_at = time.perf_counter()
        tracing.event("job_cancelled", job=job_id)
        await asyncio.shield(cancel_quietly(self._queue, job_id))
        if gone:
            metrics.DISCONNECT_CANCEL.observe(time.perf_counter() - gone_at)

    async def came(self, caller_id: str) -> None:
        """A reader of the resumable request ``caller_id`` came: a Generate stream or an Attach."""
        await self._count(caller_id, 1)

    async def went(self, caller_id: str) -> None:
        """A reader of the resumable request ``caller_id`` went, however its stream ended."""
        await self._count(caller_id, -1)

    async def _count(self, caller_id: str, delta: int) -> None:
        try:
            await self._queue.reading(caller_id, delta)
        except errors.QueueUnavailable:  # counted high, the request runs to its end; low, as before
            log.warning("readers_not_counted", request_id=caller_id, delta=delta)

    async def _expire(self, caller_id: str, job_id: str, seen: int) -> None:
        """Cancel the job unless someone attached since the timer started or a reader (the caller's
        first stream, through any gateway, or another Attach) still reads it."""
        await asyncio.sleep(self._grace_s)
        try:
            if await self._queue.attach_count(caller_id) == seen and await self._queue.reading(caller_id, 0) <= 0:
                log.info("request_detach_expired", request_id=caller_id)
                await cancel_quietly(self._queue, job_id)
        except errors.QueueUnavailable:
            await cancel_quietly(self._queue, job_id)

    async def close(self) -> None:
        """Cancel every timer (the gateway is stopping) and wait for them to end."""
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
