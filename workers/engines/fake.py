"""A deterministic engine for tests: no model, same contract as the real ones.

Token ``i`` of a request is ``(seed + i) % 1000`` where ``seed`` is derived from the
prompt (or the request's seed), and its text is ``" w<id>"``. Each step takes
``settings.fake_step_s`` seconds, and like a real engine every running request
advances on the same step (one shared clock). Aborts are recorded in ``aborted``.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator

from llamamesh.errors import EngineDead, InvalidRequest, PromptTooLong
from llamamesh.settings import WorkerSettings
from llamamesh.types import FinishReason, GenerationRequest, TokenDelta, TokenLogprob
from workers.engines.base import EngineStats

VOCAB = 1000
EOS_ID = 0


def _input_text(request: GenerationRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    return "".join(f"<{m.role}>{m.content}" for m in request.messages or ())


class FakeEngine:
    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        self._running: dict[str, asyncio.Event] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._tick: asyncio.Future[None] | None = None
        self.dead = False
        self.aborted: list[str] = []
        self.served: list[str] = []

    @property
    def model_name(self) -> str:
        return self._settings.model

    async def start(self) -> None:
        if self._settings.fake_step_s:
            self._tick = asyncio.get_running_loop().create_future()
            self._ticker = asyncio.create_task(self._run_clock(), name="fake-engine-clock")

    async def _run_clock(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._settings.fake_step_s)
            tick, self._tick = self._tick, loop.create_future()
            if tick is not None:
                tick.set_result(None)

    async def _next_step(self) -> None:
        if self._tick is None:
            await asyncio.sleep(0)
        else:
            await asyncio.shield(self._tick)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        return [zlib.crc32(w.encode()) % VOCAB for w in _input_text(request).split()]

    def _validate(self, request: GenerationRequest) -> int:
        s = request.sampling
        if s.logprobs is not None and s.logprobs > 20:
            raise InvalidRequest.field("logprobs", "at most 20 alternatives per token")
        if any(t < 0 or t >= VOCAB for t in s.stop_token_ids):
            raise InvalidRequest.field("stop_token_ids", f"token ids must be in [0, {VOCAB})")
        n_prompt = len(_input_text(request).split())
        if n_prompt >= self._settings.max_model_len:
            raise PromptTooLong.field("prompt", f"{n_prompt} tokens, limit {self._settings.max_model_len}")
        return n_prompt

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self.dead:
            raise EngineDead("the fake engine is dead")
        n_prompt = self._validate(request)
        s = request.sampling
        base = s.seed if s.seed is not None else zlib.crc32(_input_text(request).encode())
        max_tokens = s.max_tokens or 16
        abort = self._running[request.request_id] = asyncio.Event()
        self.served.append(request.request_id)
        text = ""
        try:
            for i in range(max_tokens):
                await self._next_step()
                if abort.is_set():
                    yield TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=n_prompt)
                    return
                if self.dead:
                    raise EngineDead("the fake engine died mid-stream")
                tok = (base + i + 1) % VOCAB or 1
                piece = f" w{tok}"
                text += piece
                lps = (TokenLogprob(tok, -0.5),) if s.logprobs is not None else ()
                hit = next((x for x in s.stop if x in text), None)
                if hit is not None:
                    yield TokenDelta(
                        text=piece[: len(piece) - (len(text) - text.index(hit))],
                        token_ids=(tok,),
                        logprobs=lps,
                        finish_reason=FinishReason.STOP_SEQUENCE,
                        prompt_tokens=n_prompt,
                    )
                    return
                if tok in s.stop_token_ids:
                    yield TokenDelta(token_ids=(tok,), logprobs=lps, finish_reason=FinishReason.STOP,
                                     prompt_tokens=n_prompt)
                    return
                last = i == max_tokens - 1
                yield TokenDelta(
                    text=piece,
                    token_ids=(tok,),
                    logprobs=lps,
                    finish_reason=FinishReason.LENGTH if last else None,
                    prompt_tokens=n_prompt if last else None,
                )
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request.request_id)
            raise
        finally:
            self._running.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        ev = self._running.get(request_id)
        if ev is not None and not ev.is_set():
            self.aborted.append(request_id)
            ev.set()

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDead("the fake engine is dead")

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running))

    async def shutdown(self) -> None:
        for ev in self._running.values():
            ev.set()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None
