"""What happens to a request's job when its caller leaves: a resumable request is detached (a timer
cancels it after the re-attach grace unless someone attaches meanwhile), any other is cancelled.

``DetachTimers`` owns the timers of one relay and cancels them at its close; ``cancel_quietly``
cancels a job when nobody waits for the answer (Redis being out is logged, not raised).
"""

from __future__ import annotations

import asyncio

import structlog

from llamamesh import errors
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

    async def _expire(self, caller_id: str, job_id: str, seen: int) -> None:
        await asyncio.sleep(self._grace_s)
        try:
            if await self._queue.attach_count(caller_id) == seen:
                log.info("request_detach_expired", request_id=caller_id)
                await cancel_quietly(self._queue, job_id)
        except errors.QueueUnavailable:
            await cancel_quietly(self._queue, job_id)

    async def close(self) -> None:
        """Cancel every timer (the gateway is stopping) and wait for them to end."""
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
