"""``n`` parallel samples on any engine (GenerateRequest.n): :class:`Samples`, the worker's way into its
engine, passes a request to an engine that samples in parallel itself, or runs one engine request
per sample and merges their deltas, each tagged with its sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from types import MappingProxyType

from llamamesh.types import FinishReason, GenerationRequest, TokenDelta
from workers.engines.base import Engine


def sample_requests(request: GenerationRequest) -> list[tuple[int, GenerationRequest]]:
    """One single-sample engine request per sample still to run (``<request id>~s<k>``): every sample
    of a fresh request, or the ``resume_samples`` of a resumed one, each from its own tokens with the
    rest of its budget. Sample ``k`` of a seeded request uses ``seed + k``, as vLLM's parallel
    sampling does."""
    s = request.sampling
    todo = dict(request.resume_samples) or dict.fromkeys(range(s.samples), ())
    out = []
    for k, done in sorted(todo.items()):
        params = replace(s.after(len(done)), n=None, seed=None if s.seed is None else s.seed + k)
        sub = replace(
            request,
            request_id=f"{request.request_id}~s{k}",
            sampling=params,
            resume_token_ids=tuple(done),
            resume_samples=MappingProxyType({}),
        )
        out.append((k, sub))
    return out


def fans_out(engine: object, request: GenerationRequest) -> bool:
    """Whether ``request`` runs as one engine request per sample on ``engine``: an engine that samples
    in parallel itself (``parallel_samples``: vLLM, whose ``SamplingParams.n`` prefills the prompt
    once and forks the sequences) gets the request as it is and tags each delta with its sample.
    Every other engine (the CPU engine, TensorRT-LLM's adapter) fans out, and so does a resumed
    request of several samples on any engine (each sample goes on from its own tokens, which no
    engine's ``n`` can express)."""
    if request.resume_samples:
        return True
    return request.sampling.samples > 1 and not getattr(engine, "parallel_samples", False)


class Samples:
    """The worker's way into its engine for generation jobs: ``stream`` and ``abort`` with ``n``. The
    merged stream keeps the engine contract (workers/engines/base.py): each sample's last delta has
    its finish_reason and prompt_tokens; an abort (of the request id: :meth:`abort` reaches every
    sample) ends the stream with one CANCELLED delta; an error of any sample stops the others and is
    raised."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._subs: dict[str, tuple[str, ...]] = {}  # request id -> its samples' engine request ids
        # Requests in the engine now: streams begun and not ended, tokenizations under way. The
        # worker's watchdog calls an engine wedged only while this is above 0 (a job that finished
        # generating and waits on Redis to record its result is not the engine's).
        self.in_engine = 0

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not fans_out(self.engine, request):
            return self._counted(self.engine.stream(request))
        return self._counted(self._merged(request))

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        self.in_engine += 1
        try:
            return await self.engine.tokenize(request)
        finally:
            self.in_engine -= 1

    async def _counted(self, inner: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        self.in_engine += 1
        try:
            async for delta in inner:
                yield delta
        finally:
            self.in_engine -= 1
            close = getattr(inner, "aclose", None)
            if close is not None:  # the engine's clean-up (its abort of an unfinished request) now
                await close()

    async def abort(self, request_id: str) -> None:
        """Stop a request, every sample of it."""
        subs = self._subs.get(request_id)
        if subs is None:
            await self.engine.abort(request_id)
            return
        for sub in subs:
            await self.engine.abort(sub)

    async def _merged(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        rid = request.request_id
        subs = sample_requests(request)
        self._subs[rid] = tuple(sub.request_id for _, sub in subs)
        inbox: asyncio.Queue[TokenDelta | BaseException | None] = asyncio.Queue()

        async def pump(k: int, sub: GenerationRequest) -> None:
            try:
                async for delta in self.engine.stream(sub):
                    inbox.put_nowait(replace(delta, sample=k))
            except BaseException as exc:
                inbox.put_nowait(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                inbox.put_nowait(None)

        tasks = [asyncio.create_task(pump(k, sub), name=f"sample-{sub.request_id}") for k, sub in subs]
        running = len(tasks)
        cancelled: TokenDelta | None = None
        try:
            while running:
                item = await inbox.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is FinishReason.CANCELLED:
                    # One sample aborted (the request's abort reaches all of them): the request ends
                    # with one CANCELLED once every sample stopped.
                    if cancelled is None:
                        cancelled = TokenDelta(
                            finish_reason=FinishReason.CANCELLED, prompt_tokens=item.prompt_tokens, sample=item.sample
                        )
                        await self.abort(rid)
                    continue
                if cancelled is not None:
                    continue  # what the other samples made while they were being stopped
                yield item
            if cancelled is not None:
                yield cancelled
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._subs.pop(rid, None)
