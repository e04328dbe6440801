"""What a caller asks for: a generation or tokenization request, its sampling and constraints,
and the gateway's record of each attempt at it."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType


class JobKind(str, enum.Enum):
    GENERATE = "generate"
    TOKENIZE = "tokenize"


CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    # An assistant turn's tool calls: a JSON list of {"id", "name", "arguments"}; "": none.
    tool_calls: str = ""
    # A tool turn: the id of the call it answers.
    tool_call_id: str = ""


class ConstraintKind(str, enum.Enum):
    """The kinds of GenerateRequest.response_format, named as its fields."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class ResponseConstraint:
    """What the output must follow: ``text`` is the JSON schema, regex or grammar; ``options`` the
    choice's strings; a JSON object needs neither."""

    kind: ConstraintKind
    text: str = ""
    options: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The public field it came from, for errors: ``response_format.json_schema``, ..."""
        return f"response_format.{self.kind.value}"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters; ``None`` means "the engine's default"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    # Constrained decoding (GenerateRequest.response_format); None: free text.
    constraint: ResponseConstraint | None = None
    # Parallel samples of the one prompt (GenerateRequest.n); None: one.
    n: int | None = None

    @property
    def samples(self) -> int:
        """How many samples the request generates (``n``, at least 1)."""
        return max(self.n or 1, 1)

    def after(self, done: int) -> SamplingParams:
        """These parameters for the rest of a sample of which ``done`` tokens were generated already:
        the rest of ``max_tokens`` and of ``min_tokens``."""
        return replace(
            self,
            max_tokens=None if self.max_tokens is None else self.max_tokens - done,
            min_tokens=None if self.min_tokens is None else max(0, self.min_tokens - done),
        )


@dataclass(frozen=True)
class GenerationRequest:
    """One validated unit of work: a generation, or a tokenization (``kind``)."""

    request_id: str
    model: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    kind: JobKind = JobKind.GENERATE
    # Wall clock (Unix ns) when the gateway accepted it.
    accepted_unix_ns: int = 0
    # Mid-stream failover: tokens an earlier attempt already generated and the caller already has.
    # The engine feeds the input followed by these and generates what follows (its max_tokens and
    # min_tokens already count only the rest); it reports prompt_tokens without them.
    resume_token_ids: tuple[int, ...] = ()
    # A batch item: its batch and its custom_id (empty for interactive requests).
    batch_id: str = ""
    custom_id: str = ""
    # Wall clock (Unix ns) after which it is not started, or is aborted if running; 0: none (the
    # caller's gRPC deadline).
    deadline_unix_ns: int = 0
    # The caller's request id when this is a later attempt of it (failover); empty: request_id.
    origin_id: str = ""
    # The tenant that submitted it (empty: the default tenant); its ids are namespaced by it
    # (``scoped_id``) and it waits in the tenant's sub-stream of its pool.
    tenant: str = ""
    # The W3C trace context (``traceparent``/``tracestate``) of the gateway span that submitted it
    # (llamamesh/tracing.py); empty: not traced.
    trace: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Prefix affinity: the key whose hash picks its partition stream of the pool (docs/affinity.md):
    # the caller's GenerateRequest.prefix_key, else ``affinity_key`` of its input. Empty: its
    # request id's (no affinity).
    prefix_key: str = ""
    # Mid-stream failover of a request with n > 1 samples: the samples still to finish, each with
    # the tokens the caller already has of it (sample index -> ids); only these run, each from its
    # own tokens (max_tokens and min_tokens count each sample's rest). Empty: every sample from the
    # start (then ``resume_token_ids`` is for n == 1).
    resume_samples: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # The LoRA adapter to generate with (GenerateRequest.adapter, or model "base:adapter"); empty:
    # the base model.
    adapter: str = ""
    # Tool calling: the tools for the chat template, a JSON list of {"name", "description",
    # "parameters"} ("": none; the gateway leaves them out when the caller chose "none").
    tools: str = ""
    # The engine's prefix-cache salt (vLLM's and TensorRT-LLM's cache_salt): set by the gateway from
    # the tenant when the cache is the tenant's (LLAMAMESH_GATEWAY_CACHE_SCOPE); "": shared.
    cache_salt: str = ""

    @property
    def caller_id(self) -> str:
        """The request id the caller knows (and may cancel)."""
        return self.origin_id or self.request_id


# Longest GenerateRequest.prefix_key, in characters.
MAX_PREFIX_KEY_CHARS = 256


def affinity_key(prompt: str | None, messages: tuple[ChatMessage, ...] | None, chars: int) -> str:
    """The prefix key of a request that names none: a hash (blake2b, hex) of the first ``chars``
    characters of its prompt, or of its chat messages rendered as role and content in order (the
    system prompt first, as the caller sent it), so that requests sharing that start share a key.
    ``chars`` <= 0 or no input: "" (no affinity)."""
    if chars <= 0:
        return ""
    if prompt is not None:
        text = prompt
    elif messages:
        ordered = [m for m in messages if m.role == "system"] + [m for m in messages if m.role != "system"]
        text = "".join(f"{m.role}\x1f{m.content}\x1e" for m in ordered)
    else:
        return ""
    return hashlib.blake2b(text[:chars].encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Attempt:
    """One attempt of a caller's request, as the gateway records it for re-attaching: the job's
    request id, how many tokens the caller had when it started (``base``), where it runs."""

    attempt_id: str
    base: int
    pool: str
    model: str
    accepted_unix_ns: int
    resumable: bool = False
    # A digest of the request as the caller sent it (first attempt): a reused request id with a
    # different request is refused (ALREADY_EXISTS), the identical one is an idempotent retry.
    fingerprint: str = ""
    # A request of n > 1 samples: how many tokens of each sample the caller had when this attempt
    # started (``base`` is their sum), and which samples had ended then (they do not run again).
    bases: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()

    def base_of(self, sample: int) -> int:
        """Tokens of ``sample`` before this attempt."""
        if not self.bases:
            return self.base if sample == 0 else 0
        return self.bases[sample] if sample < len(self.bases) else 0
