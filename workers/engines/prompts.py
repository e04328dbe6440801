"""A request's prompt to token ids: one request (:func:`render_prompt_ids`), or every request that
arrives together in one call of the tokenizer (:class:`BatchTokenizer`, what the GPU adapters use).
Pure Python; imports no engine library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from llamamesh.errors import InvalidRequest, PromptTooLong
from llamamesh.types import GenerationRequest

log = structlog.get_logger(__name__)

# At most this many requests in one call of the tokenizer: the requests that arrive while a batch is
# being encoded wait for it, so a bound keeps one batch's time (and the wait behind it) small.
MAX_BATCH = 64


def prompt_text(request: GenerationRequest, tokenizer: Any) -> tuple[str, bool]:
    """The text to encode for ``request`` and whether the tokenizer adds its special tokens: the prompt
    as is with them (as vLLM's completions path), or the messages through the chat template without
    (as its chat path). InvalidRequest if neither or both are set, or the template fails."""
    if request.prompt is not None and request.messages is not None:
        raise InvalidRequest.field("messages", "set prompt or messages, not both")
    if request.messages is not None:
        if not request.messages:
            raise InvalidRequest.field("messages", "at least one message is required")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest.field("messages", "this model has no chat template; send a prompt")
        template = tokenizer.chat_template
        chat, tools = chat_turns(request, template)
        try:
            # The template given, not left to the tokenizer: vLLM's renders on copies of itself made
            # when it was built (vllm/tokenizers/hf.py, maybe_make_thread_pool), which a template set
            # on it later (use_chat_template) does not reach. (A model's named templates, a dict,
            # are left to the tokenizer to choose from.)
            given = {"chat_template": template} if isinstance(template, str) else {}
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **given, **tools)
        except Exception as exc:  # jinja raises whatever the template author chose
            raise InvalidRequest.field("messages", f"the chat template rejected them: {exc}") from exc
        return text, False
    if request.prompt is None:
        raise InvalidRequest.field("prompt", "either prompt or messages is required")
    return request.prompt, True


def read_chat_template(path: str) -> str | None:
    """The text of the chat template file ``path`` (LLAMAMESH_WORKER_CHAT_TEMPLATE), checked to be
    Jinja; None for "" (the model's own). ValueError, naming the setting, if it cannot be read or
    parsed."""
    if not path:
        return None
    import jinja2

    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
        jinja2.Environment().parse(text)
    except (OSError, UnicodeDecodeError, jinja2.TemplateSyntaxError) as exc:
        raise ValueError(f"LLAMAMESH_WORKER_CHAT_TEMPLATE: {path!r}: {exc}") from exc
    if not text.strip():
        raise ValueError(f"LLAMAMESH_WORKER_CHAT_TEMPLATE: {path!r} is empty")
    return text


def use_chat_template(tokenizer: Any, path: str) -> Any:
    """``tokenizer``, rendering chats with the template file ``path`` when one is set."""
    text = read_chat_template(path)
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer


# The tools, for a chat template that does not render them itself: a system turn in the form Llama
# 3.1's own template uses for JSON tool calls, so that the model is told the same thing.
TOOLS_TURN = (
    "You have access to the following functions. To call a function, respond with JSON for a function "
    'call, in the format {{"name": function name, "parameters": dictionary of argument name and its '
    "value}}. Do not use variables.\n\n{tools}"
)


def chat_turns(request: GenerationRequest, template: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The request's messages as the chat template's turns (tool calls and tool turns in the form
    Hugging Face's templates take), and the template's ``tools`` argument. A template that does not
    render tools gets them as a first system turn (``TOOLS_TURN``) instead."""
    chat: list[dict[str, Any]] = []
    for m in request.messages or ():
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.loads(c["arguments"])},
                }
                for c in json.loads(m.tool_calls)
            ]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        chat.append(turn)
    if not request.tools:
        return chat, {}
    tools = [{"type": "function", "function": t} for t in json.loads(request.tools)]
    if "tools" in str(template or ""):
        return chat, {"tools": tools}
    described = TOOLS_TURN.format(tools="\n\n".join(json.dumps(t, indent=2) for t in tools))
    if chat and chat[0]["role"] == "system":  # one system turn: the caller's, then the tools
        return [{**chat[0], "content": f"{chat[0]['content']}\n\n{described}"}, *chat[1:]], {}
    return [{"role": "system", "content": described}, *chat], {}


def _token_chars(tokenizer: Any) -> int:
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # no get_vocab: no bound
        return 0


_token_chars_cached = functools.lru_cache(maxsize=8)(_token_chars)


def token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for, from its vocabulary (a byte-level
    token's raw form has a character per byte: at least as many as it decodes to); 0 if unknown.
    Read once per tokenizer (a vocabulary of 128 k tokens takes some 30 ms)."""
    try:
        return _token_chars_cached(tokenizer)
    except TypeError:  # a tokenizer that cannot be a key: read each time
        return _token_chars(tokenizer)


def check_chars(request: GenerationRequest, text: str, tokenizer: Any, limit: int) -> None:
    """Refuse, without tokenising it, a prompt too long for ``limit`` tokens (the engine's context,
    output included) whatever its tokens: more characters than twice ``limit - 1`` of the longest
    tokens (twice: room for a normaliser that folds characters). Tokenising a prompt of megabytes
    takes seconds on the engine's tokenizer thread, which on the CPU engine is its step thread."""
    most = (limit - 1) * token_chars(tokenizer) * 2 if limit else 0
    if most and len(text) > most:
        field = "messages" if request.messages is not None else "prompt"
        raise PromptTooLong.field(field, f"{len(text)} characters, more than {limit - 1} tokens can hold")


def render_prompt_ids(request: GenerationRequest, tokenizer: Any, limit: int = 0) -> list[int]:
    """The token ids for ``request`` (:func:`prompt_text`, encoded); with ``limit``, a prompt that
    cannot fit refused first (:func:`check_chars`)."""
    text, special = prompt_text(request, tokenizer)
    check_chars(request, text, tokenizer, limit)
    return list(tokenizer.encode(text, add_special_tokens=special))


def render_batch(requests: list[GenerationRequest], tokenizer: Any, limit: int = 0) -> list[list[int] | Exception]:
    """:func:`render_prompt_ids` of each request, in order, or the exception it raised (one request's
    bad input fails only that request). The texts are encoded in one call of the tokenizer on a list
    per special-token setting where the tokenizer takes lists; one call per text where it does not (or
    the list call fails, so that each text gets its own answer)."""
    out: list[list[int] | Exception] = [[] for _ in requests]
    groups: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
    for i, request in enumerate(requests):
        try:
            text, special = prompt_text(request, tokenizer)
            check_chars(request, text, tokenizer, limit)
        except Exception as exc:
            out[i] = exc
            continue
        groups[special].append((i, text))
    for special, group in groups.items():
        if not group:
            continue
        encoded: Any = None
        if len(group) > 1 and callable(tokenizer):
            try:
                encoded = tokenizer([text for _, text in group], add_special_tokens=special)["input_ids"]
                if len(encoded) != len(group):
                    encoded = None
            except Exception as exc:
                log.debug("batch_encode_failed", error=repr(exc), texts=len(group))
                encoded = None
        for n, (i, text) in enumerate(group):
            try:
                ids = encoded[n] if encoded is not None else tokenizer.encode(text, add_special_tokens=special)
                out[i] = list(ids)
            except Exception as exc:
                out[i] = exc
    return out


class BatchTokenizer:
    """Renders requests to token ids with ``tokenizer()`` (the engine's tokenizer, looked up for each
    batch) on ``executor`` (one thread), in batches: whatever arrived while the last batch was being
    encoded goes in the next (up to :data:`MAX_BATCH`, first come first). :meth:`ids` raises what
    rendering its request raised; a caller cancelled while it waits is left out of its batch.

    Why batches: a wave of new requests (a closed-loop client's round, a burst of callers) tokenised
    one request after another on the adapter's one tokenizer thread reaches the engine late, the
    last prompt long after the first (docs/benchmarks.md). Hugging Face's fast tokenizers encode a
    list in parallel in Rust, and vLLM's own API server batches its encode calls the same way
    (``AsyncMicrobatchTokenizer``). The ids are the same as one call per request: each text is
    encoded on its own, without padding or truncation."""

    def __init__(
        self,
        tokenizer: Callable[[], Any],
        executor: concurrent.futures.Executor,
        max_batch: int = MAX_BATCH,
        limit: Callable[[], int] = lambda: 0,
    ) -> None:
        """``limit``: the engine's context in tokens (0: not known), for :func:`check_chars`."""
        self._tokenizer = tokenizer
        self._limit = limit
        self._executor = executor
        self._max_batch = max_batch
        self._waiting: list[tuple[GenerationRequest, asyncio.Future[list[int]]]] = []
        self._drainer: asyncio.Task[None] | None = None
        # How many requests each of the last batches held (for tests and benchmarks; bounded, as the
        # worker runs for days).
        self.batches: deque[int] = deque(maxlen=64)

    async def ids(self, request: GenerationRequest) -> list[int]:
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="llamamesh-tokenize")
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[tuple[GenerationRequest, asyncio.Future[list[int]]]] = []
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[: self._max_batch], self._waiting[self._max_batch :]
                batch = [item for item in batch if not item[1].done()]  # callers gone before their turn
                if not batch:
                    continue
                self.batches.append(len(batch))
                answers: list[list[int] | Exception]
                try:
                    answers = await loop.run_in_executor(
                        self._executor,
                        render_batch,
                        [request for request, _ in batch],
                        self._tokenizer(),
                        self._limit(),
                    )
                except Exception as exc:  # the executor was shut down
                    answers = [exc] * len(batch)
                for (_, future), answer in zip(batch, answers, strict=True):
                    if future.done():
                        continue
                    if isinstance(answer, Exception):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
        finally:  # cancelled (the loop is closing): no caller is left waiting for good
            for _, future in batch + self._waiting:
                if not future.done():
                    future.cancel()
