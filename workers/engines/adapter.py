"""What the engine adapters share: the prompt-length check, finish reasons and logprobs as ours, and
:class:`LibraryEngine`, the skeleton of ``tokenize`` / ``stream`` / ``abort`` around a GPU library's
own calls. Pure Python (no torch, vLLM or TensorRT-LLM import), so each adapter imports it without
pulling in another's library. Each adapter names its own library's words (its finish reasons, its
length limit, its errors) where they differ.

Used by: the vllm*.py and trtllm*.py adapters (all of it), transformers_batch.py (the length check).
The prompt's rendering to ids is in prompts.py.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Collection, Mapping, Sequence
from typing import Any

import structlog

from llamamesh.errors import EngineDead, InternalError, InvalidRequest, NotFound, PromptTooLong
from llamamesh.settings import WorkerSettings, adapter_table
from llamamesh.types import (
    FinishReason,
    GenerationRequest,
    JobKind,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from workers.engines.base import remember
from workers.engines.prompts import BatchTokenizer
from workers.engines.resumed_text import ResumedText

log = structlog.get_logger(__name__)

# Our SamplingParams field names, which the libraries' errors may name.
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def check_prompt_tokens(n_tokens: int, limit: int, input_field: str, limit_name: str) -> None:
    """Refuse an empty prompt, and one that leaves no room for an output token within ``limit`` (the
    engine's ``limit_name``: max_model_len, max_seq_len); 0: the limit is not known here."""
    if n_tokens == 0:
        raise InvalidRequest.field(input_field, "the prompt has no tokens")
    if limit and n_tokens >= limit:
        raise PromptTooLong.field(
            input_field, f"{n_tokens} tokens, limit {limit - 1} ({limit_name} {limit} counts the output)"
        )


def finish_reason_of(
    reason: str | None, stop_reason: int | str | None, *, engine: str, cancelled: str, also_stop: Collection[str] = ()
) -> FinishReason | None:
    """A library's finish_reason / stop_reason as ours: a stop string (str stop_reason) is
    STOP_SEQUENCE; the end token or a stop token id is STOP; ``cancelled`` is the library's word for
    an aborted request, ``also_stop`` other endings that mean STOP. Anything else raises InternalError."""
    if reason is None:
        return None
    if reason == "stop":
        return FinishReason.STOP_SEQUENCE if isinstance(stop_reason, str) else FinishReason.STOP
    if reason == "length":
        return FinishReason.LENGTH
    if reason == cancelled:
        return FinishReason.CANCELLED
    if reason in also_stop:
        return FinishReason.STOP
    raise InternalError(f"{engine} ended the request with finish_reason {reason!r}")


def token_logprobs(
    token_ids: Sequence[int], positions: Sequence[Any] | None, n: int | None
) -> tuple[TokenLogprob, ...]:
    """Per-token logprobs as TokenLogprobs: the sampled token's logprob and at most ``n`` alternatives
    by rank (the sampled one among them when it ranks in the top ``n``). A position is the libraries'
    ``{token_id: Logprob(logprob, rank)}``, or a float (the sampled token's alone, as TensorRT-LLM may
    give), or None (nothing known: NaN)."""
    if n is None or not positions:
        return ()
    keep = max(n, 0)
    out = []
    for token, position in zip(token_ids, positions, strict=False):
        if position is not None and not isinstance(position, Mapping):
            out.append(TokenLogprob(int(token), float(position)))
            continue
        entries = position or {}
        chosen = entries.get(token)
        ranked = sorted(
            entries.items(),
            key=lambda kv: (kv[1].rank if kv[1].rank is not None else float("inf"), -kv[1].logprob),
        )
        top = tuple(TopLogprob(int(t), float(lp.logprob)) for t, lp in ranked[:keep])
        out.append(TokenLogprob(int(token), float(chosen.logprob) if chosen is not None else float("nan"), top))
    return tuple(out)


async def cancel_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task (if any) and wait until it has ended."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def lora_id(name: str) -> int:
    """The ``lora_int_id`` (vLLM's, TensorRT-LLM's) of an adapter name: from the name alone, so the same
    in every frontend process of one vLLM engine core (which keys its adapters by it), > 0."""
    return 1 + zlib.crc32(name.encode()) % (2**31 - 2)


class LibraryEngine(abc.ABC):
    """The skeleton both GPU adapters (vllm.py, trtllm.py) share: ``tokenize``, ``stream`` and
    ``abort`` around their library's own calls (the hooks below). The adapter sets ``_llm``, ``_api``
    and ``_tokenizer`` at start, ``_dead`` (why it is dead) when it dies, and counts ``_outputs`` (the
    engine's step count for the wedge watch); ``_streams`` maps request ids to their state (with
    ``aborted``), ``aborted`` lists the ids it aborted.

    ``stream`` gives: invalid input raises InvalidRequest (PromptTooLong for a long prompt) before any
    delta, a dead engine EngineDead; deltas without text or tokens are skipped; the final delta carries
    prompt_tokens (without resumed tokens); :meth:`abort` ends the stream with one CANCELLED delta; a
    consumer that goes away (cancelled, or stops iterating) has the request stopped in the library."""

    library = ""  # its name in errors: "vLLM", "TensorRT-LLM"

    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings
        self._llm: Any = None  # the library's engine, once started
        self._api: Any = None  # the library's names, imported at start
        self._tokenizer: Any = None
        self._streams: dict[str, Any] = {}
        # Chat templates and tokenization run here, off the event loop (one thread: HF tokenizers), for
        # every request that arrived together in one call of the tokenizer.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamamesh-tok")
        self._prompts = BatchTokenizer(lambda: self._tokenizer, self._executor, limit=self._prompt_limit)
        self._dead: str | None = None
        self._starting = ""
        # Library outputs delivered to our streams (the watchdog's sign of progress).
        self._outputs = 0
        self.aborted: list[str] = []
        # LoRA adapters (name -> folder): LLAMAMESH_WORKER_ADAPTERS, and those loaded at run time.
        self._adapters: dict[str, str] = adapter_table(settings.adapters)

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(sorted(self._adapters))

    def _adapter_path(self, request: GenerationRequest) -> str | None:
        """The folder of the request's adapter (None: the base model); NotFound if not loaded here."""
        if not request.adapter:
            return None
        path = self._adapters.get(request.adapter)
        if path is None:
            raise NotFound(f"adapter {request.adapter!r} is not loaded on this worker")
        return path

    @property
    def model_name(self) -> str:
        return self._settings.model

    def _started(self) -> tuple[Any, Any]:
        """(the library's engine, its imported names); EngineDead if not running."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._llm is None or self._api is None:
            raise EngineDead("the engine is not started")
        return self._llm, self._api

    # --- hooks

    @abc.abstractmethod
    def _new_stream(self) -> Any:
        """A fresh per-request state with an ``aborted`` flag."""

    @abc.abstractmethod
    def _library_params(self, request: GenerationRequest, api: Any, input_field: str) -> Any:
        """The library's sampling parameters for ``request``; InvalidRequest naming our field."""

    @abc.abstractmethod
    def _check_length(self, n_tokens: int, input_field: str) -> None:
        """Refuse a prompt (resumed tokens included) that leaves no room for output, where known."""

    @abc.abstractmethod
    def _deltas(
        self,
        llm: Any,
        api: Any,
        request: GenerationRequest,
        ids: list[int],
        params: Any,
        state: Any,
        input_field: str,
        tokenize_ms: float,
    ) -> AsyncIterator[TokenDelta]:
        """Run ``ids`` in the library and map each output to a delta; the last one has a finish reason
        (and ends the iteration), or the iteration ends without one when the request was aborted.
        Closing it early must stop the request in the library where the library does not."""

    @abc.abstractmethod
    def _abort_in_library(self, request_id: str, state: Any) -> Awaitable[None] | None:
        """Stop a running request in the library (:meth:`abort`)."""

    def _held_back(self, request: GenerationRequest) -> int | None:
        """How many characters of ``request``'s text the library streams behind its tokens (to keep
        stop strings out of the text); None where not known: a resumed request then gets no help at
        its failover point (resumed_text.py)."""
        return None

    def _prompt_limit(self) -> int:
        """The engine's context in tokens, output included, once known (0: not known): a prompt that
        cannot fit is refused before it is tokenised (prompts.check_chars)."""
        return 0

    def _left(self, state: Any) -> None:  # noqa: B027 - optional hook: vLLM's generate() stops by itself
        """A stream ended without its final delta (consumer gone, or an error): stop it where needed."""

    # --- the skeleton

    async def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        try:
            return await self._prompts.ids(request)
        except RuntimeError as exc:  # the engine shut its tokenizer thread down while the request waited
            if self._dead is None:
                raise
            raise EngineDead(self._dead) from exc

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """The ids :meth:`stream` would prefill for ``request``; InvalidRequest if it has no usable input."""
        self._started()
        return await self._prompt_ids(request)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        llm, api = self._started()
        if request.kind is JobKind.TOKENIZE:
            raise InvalidRequest.field("kind", "tokenize jobs go through tokenize(), not stream()")
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequest.field("request_id", f"request {rid!r} is already in flight")
        input_field = "messages" if request.messages is not None else "prompt"
        params = self._library_params(request, api, input_field)
        state = self._streams[rid] = self._new_stream()
        finished = False
        entered = time.perf_counter()
        try:
            ids = await self._prompt_ids(request)
            tokenize_ms = (time.perf_counter() - entered) * 1e3
            if self._dead is not None:  # shut down while tokenizing
                raise EngineDead(self._dead)
            n_prompt = len(ids)
            # A resumed request: prefill what an earlier attempt generated (the library's output holds
            # only what it generates from there).
            ids += request.resume_token_ids
            if not state.aborted:
                self._check_length(len(ids), input_field)
                seam = await self._resumed_text(request)
                deltas = self._deltas(llm, api, request, ids, params, state, input_field, tokenize_ms)
                ours = self._ours(deltas, request.sampling.samples, state, seam)
                async with contextlib.aclosing(deltas), contextlib.aclosing(ours):  # type: ignore[type-var]
                    async for delta, last in ours:
                        if delta.finish_reason is not None:
                            delta = dataclasses.replace(delta, prompt_tokens=n_prompt)
                        if not last:
                            yield delta
                            continue
                        finished = True
                        del self._streams[rid]  # from here on, abort(rid) is a no-op
                        if seam is not None and seam.stopped:
                            self._left(state)  # ended here, not by the library
                        yield delta
                        return
            if not state.aborted:
                raise InternalError(f"{self.library} ended the stream without a finish_reason")
            finished = True
            del self._streams[rid]
            yield TokenDelta(finish_reason=FinishReason.CANCELLED, prompt_tokens=n_prompt)
        except (asyncio.CancelledError, GeneratorExit):
            if not finished and not state.aborted:
                remember(self.aborted, rid)
                log.info("engine_aborted", request_id=rid, reason="consumer_gone")
            raise
        finally:
            if not finished:
                self._left(state)
            self._streams.pop(rid, None)

    async def _resumed_text(self, request: GenerationRequest) -> ResumedText | None:
        """The failover point's text handling of a resumed request with stop strings (resumed_text.py),
        where the library says how far its text runs behind its tokens."""
        hold = self._held_back(request) if request.resume_token_ids else None
        if not hold:
            return None
        make = functools.partial(
            ResumedText,
            self._tokenizer,
            request.resume_token_ids,
            request.sampling.stop,
            hold,
            check=not request.sampling.min_tokens,
        )
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, make)
        except RuntimeError as exc:  # the engine shut its tokenizer thread down meanwhile
            if self._dead is None:
                raise
            raise EngineDead(self._dead) from exc

    async def _ours(
        self, deltas: AsyncIterator[TokenDelta], samples: int, state: Any, seam: ResumedText | None
    ) -> AsyncIterator[tuple[TokenDelta, bool]]:
        """The library's deltas as the stream gives them, each with whether it ends the stream: empty
        ones skipped; with ``samples`` > 1 (a library that samples in parallel) each sample ends with
        its own finish reason and the last one ends the stream; a CANCELLED end no abort asked for is
        the engine's death (EngineDead)."""
        samples_left = samples
        async for got in deltas:
            delta = got if seam is None else seam.feed(got)
            if delta.finish_reason is None:
                if delta.token_ids or delta.text:
                    yield delta, False
                continue
            if delta.finish_reason is FinishReason.CANCELLED and not state.aborted and self._dead:
                raise EngineDead(self._dead)
            if samples_left > 1 and delta.finish_reason is not FinishReason.CANCELLED:
                samples_left -= 1
                yield delta, False
                continue
            yield delta, True
            return

    async def abort(self, request_id: str) -> None:
        """Stop a running request; its stream ends with one CANCELLED delta. Unknown or finished ids are
        ignored."""
        state = self._streams.get(request_id)
        if state is None or state.aborted:
            return
        state.aborted = True
        remember(self.aborted, request_id)
        log.info("engine_aborted", request_id=request_id, reason="abort")
        pending = self._abort_in_library(request_id, state)
        if pending is not None:
            await pending
