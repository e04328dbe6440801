"""``ScriptedRelay``: the relay's fake (services/relay.py), for tests of the gRPC layer alone.

Each generate plays what ``script(request)`` returns (events as the caller numbers them, or an
exception to raise), and it remembers what it was asked: the requests, cancels, and the streams
it gave up on (the caller went away before the end). With ``stall_after`` set, a generate stops
after that many events and waits until its caller goes away: a stream still running when the
caller cancels, whatever the transport had buffered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

from llamamesh import errors
from llamamesh.types import GenerationRequest, JobEvent
from services.cursor import cut
from services.relayed import Caller, Progress

Script = Callable[[GenerationRequest], Sequence[JobEvent] | BaseException]


@dataclass
class ScriptedRelay:
    script: Script
    requests: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    closed: bool = False
    stall_after: int | None = None

    def _play(self, request: GenerationRequest) -> Sequence[JobEvent]:
        self.requests.append(request)
        out = self.script(request)
        if isinstance(out, BaseException):
            raise out
        return out

    async def generate(
        self,
        request: GenerationRequest,
        pool: str,
        progress: Progress,
        resumable: bool = False,
        caller: Caller | None = None,
    ) -> AsyncGenerator[JobEvent, None]:
        progress.pool = pool
        ended = False
        try:
            for n, ev in enumerate(self._play(request)):
                if n == self.stall_after:
                    await asyncio.Event().wait()  # until the caller goes away (cancelled)
                progress.tokens += len(ev.token_ids)
                ended = ev.terminal
                yield ev
        finally:
            if not ended:
                self.abandoned.append(request.request_id)

    async def attach(
        self, request_id: str, offset: int, count: bool = True, sample_offsets: Sequence[int] = ()
    ) -> AsyncGenerator[tuple[GenerationRequest, JobEvent], None]:
        first = next((r for r in self.requests if r.request_id == request_id), None)
        if first is None:
            raise errors.NotFound(f"no request {request_id!r} (unknown, or its events expired)")
        for ev in self._play(first):
            part = cut(ev, offset, None)
            if part is not None:
                yield first, part

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    async def tokenize(self, request: GenerationRequest, pool: str) -> JobEvent:
        return self._play(request)[-1]

    async def close(self) -> None:
        self.closed = True
