"""A deterministic engine for tests (:class:`FakeEngine`): no model, same contract as the real ones,
on a clock that steps every running request together, with prompts that make it fail on purpose.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import zlib
from collections.abc import AsyncIterator
from dataclasses import replace

from llamamesh.errors import EngineDead, FailedPrecondition, NotFound, PromptTooLong
from llamamesh.settings import WorkerSettings, adapter_table
from llamamesh.types import FinishReason, GenerationRequest, TokenDelta, TokenLogprob
from workers.engines.base import EngineStats, remember
from workers.engines.detokenizer import StopStrings
from workers.engines.params import ResolvedSampling, resolve_sampling

VOCAB = 1000
# The inputs the fake "caches" (the last ones seen).
PROMPTS_SEEN = 4096
EOS_ID = 0


def _input_text(request: GenerationRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    return "".join(f"<{m.role}>{m.content}" for m in request.messages or ())


def _word(token: int) -> str:
    """A token's text."""
    return f" w{token}"


def _said(request: GenerationRequest) -> list[str] | None:
    """The pieces of a ``__say__`` script's text (four characters a token), or None."""
    last = request.messages[-1].content if request.messages else ""
    if not last.startswith("__say__ "):
        return None
    text = last.removeprefix("__say__ ")
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)] or [""]
    return pieces[len(request.resume_token_ids) :] or [""]  # a resume goes on from its position


class FakeEngine:
    """Token ``i`` of a request is ``(seed + i) % 1000`` where ``seed`` is derived from the prompt (or
    the request's seed), and its text is ``" w<id>"``; a resumed request (``resume_token_ids``) goes
    on from position ``len(resume_token_ids)``. Each step takes ``settings.fake_step_s`` seconds (plus,
    with ``fake_step_request_s`` or ``fake_step_prompt_token_s``, a cost for each running request and
    each prompt token starting in it, as a GPU's step grows with its batch and its prefill), and
    like a real engine every running request advances on the same step (one shared clock). Aborts
    are recorded in ``aborted``. A response_format is checked like every sampling field but not
    followed: the fake has no grammar (the real engines' tests cover it).

    A script, for tests of what the gateway makes of an output: a last chat turn ``__say__ TEXT``
    makes the output TEXT, four characters a token, ending with STOP.

    Poison, for fault tests, by the prompt's first word: ``__raise__`` makes the engine raise after
    its first token; ``__die__`` kills the engine after its first token (EngineDead, as a lost GPU);
    ``__crash__`` ends the whole worker process before the first token (exit code 70), as a
    segfaulting kernel would, and ``__crash_late__`` after it. SIGUSR1 to a process running a
    started fake engine kills the engine and not the process (as killing vLLM's engine core
    process would): the requests running in it end EngineDead, whatever their prompt."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        self._running: dict[str, asyncio.Event] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._tick: asyncio.Future[None] | None = None
        self.steps = 0  # the clock's steps so far
        self._clock_start = 0.0
        self.dead = False
        self.aborted: list[str] = []
        self.served: list[str] = []
        self._prompts_seen: dict[tuple[str, str, str], None] = {}  # (adapter, salt, input), oldest first
        self.salts: list[str] = []  # each request's cache salt, in order
        self.tokens = 0
        self._prefill = 0  # prompt tokens of the requests that start in the next step
        # Tests: a wedged engine stops producing (every stream waits) while check_health passes.
        self.wedged = False
        # LoRA adapters (name -> path; the fake reads no file): an adapter shifts every token by a
        # number derived from its name, so its output differs from the base model's, the same each run.
        self._adapters: dict[str, str] = adapter_table(settings.adapters)
        self._running_adapters: dict[str, str] = {}  # request id -> its adapter

    @property
    def starting(self) -> str:
        return ""

    @property
    def model_name(self) -> str:
        return self._settings.model

    @property
    def _costed(self) -> bool:
        """Each step lasts its own cost (the requests running, the prompts starting) instead of fake_step_s."""
        return bool(self._settings.fake_step_request_s or self._settings.fake_step_prompt_token_s)

    async def start(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self._die)
        if (self._settings.fake_step_s or self._costed) and self._ticker is None:
            self._tick = asyncio.get_running_loop().create_future()
            self._clock_start = asyncio.get_running_loop().time()
            self._ticker = asyncio.create_task(self._run_clock(), name="fake-engine-clock")

    async def _run_clock(self) -> None:
        """The clock (``settings.fake_clock``). "deadline" makes step k due at start + k x step, as a
        GPU's engine core steps whatever its frontend does; when the event loop was busy past one or
        more steps, the steps it missed are not skipped: each running request gets the tokens of
        every step it missed at once (the outbox then publishes them as one event, as vLLM's output
        processor merges what queued up). So the offered rate is exactly running / step, and CPU
        contention shows as later and fuller messages. "sleep" sleeps a step after each tick: under
        load its period stretches beyond the step, so the offered rate itself drops."""
        loop = asyncio.get_running_loop()
        step = self._settings.fake_step_s
        deadline = self._settings.fake_clock == "deadline"
        start = due = self._clock_start
        while True:
            if self._costed:  # each step is due its own cost after the last one was
                due += self._step_cost()
                await asyncio.sleep(max(0.0, due - loop.time()))
                due = max(due, loop.time() - step)  # a loop late by more than a step does not catch up
                self.steps += 1
            elif deadline:
                await asyncio.sleep(max(0.0, start + (self.steps + 1) * step - loop.time()))
                # Every step due by now has happened, however late this loop woke.
                self.steps = max(self.steps + 1, self._due())
            else:
                await asyncio.sleep(step)
                self.steps += 1
            tick, self._tick = self._tick, loop.create_future()
            if tick is not None:
                tick.set_result(None)

    def _step_cost(self) -> float:
        """A GPU-like step: a fixed part, a part for each running request (decode) and one for each
        prompt token of the requests starting in it (prefill)."""
        s = self._settings
        prefill, self._prefill = self._prefill, 0
        cost = s.fake_step_s + s.fake_step_request_s * len(self._running) + s.fake_step_prompt_token_s * prefill
        return max(cost, 0.001)  # an idle engine with no fixed part still ticks, not spins

    def _due(self) -> int:
        """The steps the deadline clock has made by now (its task may not have run yet)."""
        if self._costed:  # the step under way was costed before the request came: it joins the next one
            return self.steps + 1
        elapsed = asyncio.get_running_loop().time() - self._clock_start
        return int(elapsed / self._settings.fake_step_s)

    async def _next_step(self, last: int) -> int:
        """Wait for the step after ``last`` (the one the request's previous token came from) and
        return it. On the deadline clock a step already made returns at once (a missed step is
        delivered, not skipped); on the sleep clock every token waits for the next tick."""
        if self._tick is None:
            await asyncio.sleep(0)
            return last
        if self._settings.fake_clock == "sleep":
            await asyncio.shield(self._tick)
            return self.steps
        while self.steps <= last:
            await asyncio.shield(self._tick)
        return last + 1

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(sorted(self._adapters))

    async def load_adapter(self, name: str, path: str) -> None:
        if path.startswith("missing"):  # tests: a folder that is not there
            raise NotFound(f"adapter {name!r}: no folder {path!r}")
        self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        users = sum(1 for a in self._running_adapters.values() if a == name)
        if users:  # as the CPU engine: not under running requests
            raise FailedPrecondition(f"adapter {name!r} is in use by {users} running request(s)")
        self._adapters.pop(name, None)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        return [zlib.crc32(w.encode()) % VOCAB for w in _input_text(request).split()]

    def _validate(self, request: GenerationRequest) -> tuple[int, ResolvedSampling]:
        """The prompt's length and the checked sampling parameters (the CPU engine's rules)."""
        s = request.sampling
        params = resolve_sampling(replace(s, max_tokens=16) if s.max_tokens is None else s, VOCAB)
        n_prompt = len(_input_text(request).split())
        if n_prompt + len(request.resume_token_ids) >= self._settings.max_model_len:
            raise PromptTooLong.field("prompt", f"{n_prompt} tokens, limit {self._settings.max_model_len}")
        return n_prompt, params

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """The request's tokens; the last delta says the whole prompt was cached when this engine
        saw the same input with the same cache salt before (a stand-in for a prefix cache), else
        none of it."""
        remember(self.salts, request.cache_salt)  # what the engine got: tests read it
        key = (request.adapter, request.cache_salt, _input_text(request))
        cached = key in self._prompts_seen
        self._prompts_seen[key] = None
        if len(self._prompts_seen) > PROMPTS_SEEN:
            del self._prompts_seen[next(iter(self._prompts_seen))]
        async for delta in self._stream(request):
            if delta.finish_reason is not None:
                delta = replace(delta, cached_tokens=delta.prompt_tokens if cached else 0)
            yield delta

    def _base(self, request: GenerationRequest, s: ResolvedSampling) -> int:
        """Where the request's tokens start: by its seed (or input), adapter and resume point."""
        base = s.seed if s.seed is not None else zlib.crc32(_input_text(request).encode())
        if request.adapter:
            if request.adapter not in self._adapters:
                raise NotFound(f"adapter {request.adapter!r} is not loaded on this worker")
            base += 1 + zlib.crc32(request.adapter.encode()) % 500
        return base + len(request.resume_token_ids)  # token i depends on its position only: a resume continues

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self.dead:
            raise EngineDead("the fake engine is dead")
        n_prompt, s = self._validate(request)
        base = self._base(request, s)
        # Like the real engines: the budget ends where the model's length does.
        max_tokens = min(s.max_tokens, self._settings.max_model_len - n_prompt - len(request.resume_token_ids))
        stops = StopStrings(s.stop)
        abort = self._running[request.request_id] = asyncio.Event()
        self._prefill += n_prompt
        if request.adapter:
            self._running_adapters[request.request_id] = request.adapter
        remember(self.served, request.request_id)
        poison = _input_text(request).split(" ", 1)[0]
        # Its first token comes from the clock's next step (by the time it arrived, not by a late tick).
        at = self._due() if self._tick is not None and self._settings.fake_clock == "deadline" else self.steps
        said = _said(request)
        if request.resume_token_ids and not s.min_tokens and said is None:  # as the CPU engine does
            stops.prime("".join(map(_word, request.resume_token_ids)))
        max_tokens = min(max_tokens, len(said)) if said is not None else max_tokens
        try:
            for i in range(max_tokens):
                at = await self._next_step(at)
                if abort.is_set():
                    yield TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=n_prompt)
                    return
                if self.dead:
                    raise EngineDead("the fake engine died mid-stream")
                self._poisoned(poison, i)
                while self.wedged:  # noqa: ASYNC110 - a stuck engine, for the watchdog's tests
                    await asyncio.sleep(0.05)
                self.tokens += 1
                tok = (base + i + 1) % VOCAB or 1
                lps = (TokenLogprob(tok, -0.5),) if s.logprobs is not None else ()
                if tok in s.stop_token_ids and i + 1 >= s.min_tokens:  # a stop token's own text is left out
                    yield TokenDelta(stops.flush(), (tok,), lps, FinishReason.STOP, prompt_tokens=n_prompt)
                    return
                if said is not None:  # a script: its pieces, the last one ending it (or the budget, cut short)
                    last = i == max_tokens - 1
                    yield TokenDelta(said[i], (tok,), lps, _script_end(last, i == len(said) - 1), n_prompt)
                    continue
                text, hit = stops.feed(_word(tok), check=i + 1 >= s.min_tokens)
                if hit:
                    yield TokenDelta(text, (tok,), lps, FinishReason.STOP_SEQUENCE, prompt_tokens=n_prompt)
                    return
                if i == max_tokens - 1:
                    text += stops.flush()
                    yield TokenDelta(text, (tok,), lps, FinishReason.LENGTH, prompt_tokens=n_prompt)
                    return
                yield TokenDelta(text, (tok,), lps)
        except (asyncio.CancelledError, GeneratorExit):
            remember(self.aborted, request.request_id)
            raise
        finally:
            self._running.pop(request.request_id, None)
            self._running_adapters.pop(request.request_id, None)

    def _poisoned(self, poison: str, i: int) -> None:
        """What a poison prompt does at its token ``i``: raise, kill the engine, or end the process."""
        if poison == "__crash__" or (poison == "__crash_late__" and i == 1):
            os._exit(70)
        if poison == "__raise__" and i == 1:
            raise RuntimeError("poison: the fake engine raises on this prompt")
        if poison == "__die__" and i == 1:
            self.dead = True
            raise EngineDead("poison: this prompt killed the fake engine")

    async def abort(self, request_id: str) -> None:
        ev = self._running.get(request_id)
        if ev is not None and not ev.is_set():
            remember(self.aborted, request_id)
            ev.set()

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDead("the fake engine is dead")

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), steps=self.tokens)

    def _die(self) -> None:
        self.dead = True

    async def shutdown(self) -> None:
        if threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
        for ev in self._running.values():
            ev.set()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None


def _script_end(last: bool, said_all: bool) -> FinishReason | None:
    """How a script's token ends it: its last piece with stop, the budget's last token with length."""
    return FinishReason.STOP if said_all else FinishReason.LENGTH if last else None
