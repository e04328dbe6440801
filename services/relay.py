"""The relay: the gateway's one owner of a request's stream, from the queue to the caller. ``Relay`` is
the seam (shaped like vLLM's ``EngineClient``: generate, attach, cancel, tokenize); ``QueueRelay``
implements it over the queue, ``ScriptedRelay`` (services/fake_relay.py) is its fake for tests of
the gRPC layer. The RPC handlers only convert, call the relay and map errors to statuses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol

import structlog

from llamamesh import errors
from llamamesh.queue.protocol import RelayQueue
from llamamesh.settings import GatewaySettings
from llamamesh.types import Finished, FinishReason, GenerationRequest, JobEvent, Usage
from services.attach import Attachment
from services.attempts import handed_back, raise_failure, resumed, resumed_samples
from services.backends import Backends
from services.cursor import Cursor, SampleCursors
from services.detach import DetachTimers
from services.liveness import Liveness
from services.relayed import Caller, Progress, RelayedRequest, RelayParts
from services.routing import RoutingPolicy

# Names importers take from this module; the modules above own them.
__all__ = ["Caller", "Cursor", "Progress", "QueueRelay", "Relay", "SampleCursors", "resumed", "resumed_samples"]

log = structlog.get_logger(__name__)


class Relay(Protocol):
    def generate(
        self,
        request: GenerationRequest,
        pool: str,
        progress: Progress,
        resumable: bool = False,
        caller: Caller | None = None,
    ) -> AsyncGenerator[JobEvent, None]:
        """The request's events as its caller numbers them, to the terminal one. Raises domain
        errors (a failure event becomes its error; AlreadyExists when the request id names a
        different request of ``caller``'s tenant). When the iteration stops early (the caller went
        away: cancellation or ``aclose``), a resumable request is detached (cancelled after the
        re-attach grace unless someone attaches), any other is cancelled."""
        ...

    def attach(
        self, request_id: str, offset: int, count: bool = True, sample_offsets: Sequence[int] = ()
    ) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        """A request's events from token ``offset`` on (n > 1: each sample from its entry of
        ``sample_offsets``), through its attempts, to the end, each with the request as first
        accepted (id, model, acceptance time: what its responses echo)."""
        ...

    async def cancel(self, request_id: str) -> None:
        """The caller's Cancel: every attempt stops; a queued one's stream ends now."""

    async def tokenize(self, request: GenerationRequest, pool: str) -> JobEvent:
        """The tokenized event for ``request`` (a worker of ``pool`` owns the tokenizer)."""
        ...

    async def close(self) -> None:
        """Cancel the detach timers (the gateway is stopping)."""


class QueueRelay:
    """The relay over the queue (Redis Streams in production, MemoryQueue in tests). It owns what its
    requests share (the liveness checks, the detach timers) and hands each call to the object that
    runs it: a Generate to a ``RelayedRequest`` (services/relayed.py: routing, attempts, failover, the
    bookkeeping on exit, through the stream invariant of services/cursor.py), an Attach to an
    ``Attachment`` (services/attach.py); a Cancel and a Tokenize run here."""

    def __init__(
        self,
        queue: RelayQueue,
        settings: GatewaySettings,
        backends: Backends | None = None,
        policy: RoutingPolicy | None = None,
        queue_generation: Callable[[], int] = lambda: 0,
    ) -> None:
        self._queue = queue
        self.timers = DetachTimers(queue, settings.reattach_grace_s)
        liveness = Liveness(queue, settings, backends, queue_generation)
        self._parts = RelayParts(queue, settings, backends, policy or RoutingPolicy(()), liveness, self.timers)

    async def close(self) -> None:
        await self.timers.close()

    def generate(
        self,
        request: GenerationRequest,
        pool: str,
        progress: Progress,
        resumable: bool = False,
        caller: Caller | None = None,
    ) -> AsyncGenerator[JobEvent, None]:
        return RelayedRequest(self._parts, request, pool, progress, resumable, caller).events()

    def attach(
        self, request_id: str, offset: int, count: bool = True, sample_offsets: Sequence[int] = ()
    ) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        """The caller's request from token ``offset`` on (n > 1: from ``sample_offsets``, and
        ``offset`` must be 0): see services/attach.py. Raises NotFound for an unknown (or expired)
        id. ``count``: a re-attach (it stops a detach timer); a retried Generate following its own
        request is not one."""
        p = self._parts
        return Attachment(p.queue, p.liveness, p.timers, request_id, offset, count, sample_offsets).events()

    async def cancel(self, request_id: str) -> None:
        """``Relay.cancel``; a request no worker has started gets its terminal event here."""
        await self._queue.call_off(request_id)
        records = await self._queue.attempts(request_id)
        if records and not await self._queue.read_events(records[-1].attempt_id):
            # Still queued: its stream ends now (the worker that reaches the job skips it). Numbered
            # as its worker numbers it (from the attempt's start: the readers add the attempt's base).
            ended = JobEvent(finished=Finished(FinishReason.CANCELLED, Usage(0, 0), time.time_ns()))
            await self._queue.end(records[-1].attempt_id, ended)
        log.info("request_cancel_requested", request_id=request_id)

    async def tokenize(self, request: GenerationRequest, pool: str) -> JobEvent:
        """``Relay.tokenize``, watched as a Generate is: NoWorkers for a pool with no live worker
        for LLAMAMESH_GATEWAY_NO_WORKER_WAIT_S (at once, or while it waits), WorkerLost for a worker
        that stopped answering; a job left behind is called off."""
        live = self._parts.liveness
        live.check_pool(pool)
        await self._queue.submit(pool, request)
        ended = False
        try:
            async for ev in live.watched(pool, request.request_id):
                raise_failure(ev)
                if ev.handed_back:
                    raise handed_back(ev)
                if ev.terminal:
                    ended = True
                    return ev
            raise errors.WorkerLost("the worker ended without an answer")
        finally:
            if not ended:
                with contextlib.suppress(errors.LlamameshError):
                    await self._queue.call_off(request.request_id)
