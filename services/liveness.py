"""The liveness checks of a request waiting on its attempt: its worker still alive, its pool still
able to serve it (not empty or starting for too long, not better off at its fallback), its queue
still holding its data, and its deadline within reach of the pool's queue wait.

``Liveness.watched`` reads an attempt's events and checks, every probe interval without one, that
the attempt can still end; otherwise it raises, and the request may go on elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from llamamesh import errors
from llamamesh.queue.protocol import RelayQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import JobEvent
from services.backends import Backends

# How long a lost attempt that no worker can carry on is waited for to be moved by its gateway (which
# does so as soon as it sees the loss, while it follows the request).
MOVE_WAIT_S = 5.0


class Liveness:
    """The checks for every request of one relay (``backends`` None: a relay without the view of
    the pools, as in unit tests: only the queue's data is checked)."""

    def __init__(
        self,
        queue: RelayQueue,
        settings: GatewaySettings,
        backends: Backends | None = None,
        queue_generation: Callable[[], int] = lambda: 0,
    ) -> None:
        self._queue = queue
        self._s = settings
        self._backends = backends
        self._queue_generation = queue_generation

    async def watched(self, pool: str, job_id: str) -> AsyncGenerator[JobEvent, None]:
        """The events of job ``job_id`` of ``pool``, to its terminal one. Every probe interval without
        one, check that its worker is still alive (or, before any worker took it, that its pool can
        still serve it better than the fallback): otherwise raise WorkerLost (the request may go
        elsewhere), or NoWorkers (see ``check_pool``). Raises QueueUnavailable when Redis came back
        without its data and the job is not in what it holds now (its events and job may be gone:
        never wait on them)."""
        backends = self._backends
        # One read of the events with an idle signal, not a task and a timed wait per event: at one
        # event per token per stream those cost a large share of the gateway's CPU.
        idle_s = backends.check_interval_s if backends is not None else 1.0
        events = self._queue.events_within(job_id, idle_s)
        worker = ""
        generation = self._queue_generation()
        try:
            async for item in events:
                if self._queue_generation() != generation:
                    # Lost, unless queued to the data Redis holds now (after it came back, before the
                    # gateway saw that it had: such a job runs there).
                    if not await self._queue.queued(pool, job_id):
                        raise errors.RequestLost("Redis came back without its data: this request was lost")
                    generation = self._queue_generation()
                if item is None:  # nothing for idle_s
                    self._check_waiting(pool, worker)
                    continue
                ev = item[1]
                worker = ev.worker or worker
                yield ev
                if ev.terminal:
                    return
            raise errors.WorkerLost("the event stream ended without a terminal event")
        finally:
            await events.aclose()

    async def went_on(self, request_id: str, attempt_id: str, attempts: int, lost: str) -> str:
        """After the worker ``lost`` running ``attempt_id``, the last of ``attempts`` attempts of
        ``request_id``, was lost: wait (``lost_worker_wait_s`` at most) for the request to go on.
        "moved": a later attempt was recorded (its gateway moved it); "carried": its stream moved
        again (through another worker, or the same one restarted under its name: the worker that
        reclaimed it), or ended; "": neither. ``lost`` empty (the attempt ended with the loss, or no
        worker had it yet): only a move is looked for, which a gateway following the request makes
        at once, so for ``MOVE_WAIT_S`` at most."""
        loop = asyncio.get_running_loop()
        wait_s = self._s.lost_worker_wait_s
        until = loop.time() + (wait_s if lost else min(wait_s, MOVE_WAIT_S))
        every = self._backends.check_interval_s if self._backends is not None else 0.5
        seen: int | None = None  # entries of the stream when first looked at
        while True:
            if len(await self._queue.attempts(request_id)) > attempts:
                return "moved"
            if lost:
                n, last = await self._queue.last_event(attempt_id)  # not the whole stream, every interval
                if last is not None and (last.terminal or last.worker not in ("", lost)):
                    return "carried"
                if seen is not None and n > seen:
                    return "carried"
                seen = n if seen is None else seen
            left = until - loop.time()
            if left <= 0:
                return ""
            await asyncio.sleep(min(every, left))

    def _check_waiting(self, pool: str, worker: str) -> None:
        """After an idle interval: raise unless ``worker`` (or, with none yet, ``pool``) can still
        end the job."""
        backends = self._backends
        if backends is not None and worker and not backends.worker_alive(pool, worker):
            raise errors.WorkerLost(f"worker {worker!r} of pool {pool!r} stopped answering", running=True)
        if backends is not None and not worker and backends.stranded(pool):
            raise errors.WorkerLost(f"pool {pool!r} cannot serve; its fallback can")
        if not worker:
            self.check_pool(pool)

    def check_pool(self, pool: str) -> None:
        """Raise NoWorkers (with what its workers say) when the pool had nobody for
        ``no_worker_wait_s``, or has been starting for ``start_wait_s``."""
        b, s = self._backends, self._s
        if b is None:
            return
        if s.no_worker_wait_s > 0 and b.empty_for(pool) > s.no_worker_wait_s:
            why = f"has had no live worker for {s.no_worker_wait_s:g} s"
        elif s.start_wait_s > 0 and b.starting_for(pool) > s.start_wait_s:
            why = f"has been starting for over {s.start_wait_s:g} s"
        else:
            return  # the common case, checked every interval while a request waits: no strings built
        wrong, fallback = b.what_is_wrong(pool), b.fallback.get(pool)
        raise errors.NoWorkers(
            f"the backend pool {pool!r} {why}"
            + (f" ({wrong})" if wrong else "")
            + (f" and its fallback {fallback!r} cannot take requests" if fallback else "")
        )

    def check_reachable(self, pool: str, deadline_unix_ns: int) -> None:
        """Raise DeadlineUnreachable for a request that would wait in the queue past its deadline."""
        if not deadline_unix_ns or self._backends is None:
            return
        wait = self._backends.expected_queue_wait(pool)
        remaining_s = (deadline_unix_ns - time.time_ns()) / 1e9
        if wait > 0 and remaining_s < wait:
            raise errors.DeadlineUnreachable(
                f"the deadline ({remaining_s:.3f} s) is shorter than pool {pool!r}'s queue wait ({wait:.3f} s)"
            )
