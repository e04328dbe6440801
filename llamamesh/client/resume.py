"""A Generate stream that outlives its gateway: the client's half of resumable streams.

:func:`resumed` (and :func:`resumed_sync`) give ``Client.generate`` and ``SyncClient.generate`` one
uninterrupted stream (every token once, in order, with its text) across calls that break, going on
through the same channel, so through any gateway behind it; :class:`Resumption` holds what one
stream delivered. What the caller can count on: docs/api.md ("Streams that resume").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import grpc

from llamamesh.backoff import Delays
from llamamesh.client.status import error_reason
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc

# Reasons (google.rpc.ErrorInfo) of an UNAVAILABLE that another call may not meet: the gateway
# could not reach Redis. An UNAVAILABLE without an ErrorInfo of ours is the transport's (a gateway
# killed or gone, a broken connection).
RESUMED_REASONS = frozenset({"QUEUE_UNAVAILABLE"})
CANCEL_TIMEOUT_S = 2.0
# A broken stream is called again for at least this long (and ``attempts`` times), so that a gateway
# restarting in that time (a crash, a rollout) finds its caller still there; the gateway keeps the
# request running for its re-attach grace (30 s) meanwhile.
RESUME_WINDOW_S = 10.0


def worth_resuming(err: grpc.RpcError) -> bool:
    """Whether a broken stream may go on through another call: an UNAVAILABLE of the transport (the
    gateway died or drained, the connection broke) or of a gateway that lost Redis. Errors the gateway
    itself decided (NO_WORKERS, a poisoned request, a worker lost past its failovers, any other
    status) end the stream."""
    if err.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    reason = error_reason(err)
    return not reason or reason in RESUMED_REASONS


class Resumption:
    """What one resumable stream has delivered, and the next call that goes on from there. The request
    is sent with ``resumable`` set and a ``request_id`` (one is made when the caller gives none)."""

    def __init__(
        self,
        request: pb.GenerateRequest,
        attempts: int,
        timeout: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.request = pb.GenerateRequest()
        self.request.CopyFrom(request)
        self.cancel_on_exit = not request.resumable  # the caller did not ask to keep it running
        self.request.resumable = True
        if not self.request.request_id:
            self.request.request_id = uuid.uuid4().hex
        self.n = max(request.n, 1) if request.HasField("n") else 1
        self.have = [0] * self.n  # tokens of each sample delivered
        self.ended: set[int] = set()  # samples whose end was delivered
        self.attempts = attempts
        self._clock = clock
        self.deadline = None if timeout is None else clock() + timeout
        self.done = False
        self._failures = 0
        self._failing_since = 0.0
        self._delays = Delays(first_s=0.1, cap_s=1.0)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def fresh(self, msg: pb.GenerateResponse) -> bool:
        """Count a message the caller gets; False for one it must not (the repeated end of a
        sample it has: an Attach sends each ended sample's end again)."""
        self._failures = 0
        self._delays.reset()
        if msg.sample in self.ended and not msg.token_ids:
            return False
        self.have[msg.sample] += len(msg.token_ids)
        if msg.finish_reason:
            self.ended.add(msg.sample)
        return True

    def timeout(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self._clock())

    def backoff(self, err: grpc.RpcError) -> float:
        """The wait before the next call after ``err`` (jittered, never past the caller's timeout);
        raises ``err`` when it ends the stream: not worth resuming, or ``attempts`` failures in a row
        over at least ``RESUME_WINDOW_S`` (both restart once a call delivers a message)."""
        delay = None
        now = self._clock()
        if not self._failures:
            self._failing_since = now
        if worth_resuming(err) and (self._failures < self.attempts or now - self._failing_since < RESUME_WINDOW_S):
            self._failures += 1
            delay = self._delays.next()
            left = self.timeout()
            delay = None if left is not None and left <= delay else delay
        if delay is None:
            self.done = not worth_resuming(err)  # the gateway ended it: nothing to cancel
            raise err
        return delay

    @property
    def cancel_now(self) -> pb.CancelRequest | None:
        """The Cancel to send as the caller leaves: it stopped before the end of a stream it did not
        ask to keep running."""
        return pb.CancelRequest(request_id=self.request_id) if self.cancel_on_exit and not self.done else None

    def call(self, stub: Any) -> Any:
        """The next call on ``stub`` (a GenerationService stub, async or not): before any token,
        ``Generate`` with the same request (an idempotent retry: it follows the request already
        accepted, or starts it if none was); after tokens, ``Attach`` from the count of tokens of each
        sample delivered."""
        if not any(self.have):
            return stub.Generate(self.request, timeout=self.timeout())
        attach = pb.AttachRequest(request_id=self.request_id)
        if self.n > 1:
            attach.sample_offsets.extend(self.have)
        else:
            attach.offset = self.have[0]
        return stub.Attach(attach, timeout=self.timeout())


async def resumed(
    stub: generation_pb2_grpc.GenerationServiceStub, request: pb.GenerateRequest, attempts: int, timeout: float | None
) -> AsyncGenerator[pb.GenerateResponse, None]:
    """The responses of ``request``, resumed through ``stub``'s channel when the stream breaks; the
    last error is raised when it cannot go on. A caller that stops reading before the end (or is
    cancelled) has the request cancelled with ``Cancel`` (shielded), as a plain disconnect would."""
    r = Resumption(request, attempts, timeout)
    try:
        while not r.done:
            call = r.call(stub)
            try:
                async for msg in call:
                    if r.fresh(msg):
                        yield msg
                r.done = True
            except grpc.aio.AioRpcError as err:
                await asyncio.sleep(r.backoff(err))
            finally:
                call.cancel()
    finally:
        if (cancel := r.cancel_now) is not None:
            # (UsageError: the channel closed first; its call ended with it, as a disconnect does)
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.TimeoutError):
                await asyncio.shield(stub.Cancel(cancel, timeout=CANCEL_TIMEOUT_S))


def resumed_sync(
    stub: generation_pb2_grpc.GenerationServiceStub, request: pb.GenerateRequest, attempts: int, timeout: float | None
) -> Iterator[pb.GenerateResponse]:
    """``resumed`` for the blocking client."""
    r = Resumption(request, attempts, timeout)
    try:
        while not r.done:
            call = r.call(stub)
            try:
                for msg in call:
                    if r.fresh(msg):
                        yield msg
                r.done = True
            except grpc.RpcError as err:
                time.sleep(r.backoff(err))
            finally:
                call.cancel()
    finally:
        if (cancel := r.cancel_now) is not None:
            with contextlib.suppress(grpc.RpcError):
                stub.Cancel(cancel, timeout=CANCEL_TIMEOUT_S)
