"""Plain domain types shared by the gateway, the queue layer and the workers."""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"


class JobKind(str, enum.Enum):
    GENERATE = "generate"
    TOKENIZE = "tokenize"


CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


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


# Tenant names: what the tenants file and the x-llamamesh-tenant header may hold (no "/": it
# separates a tenant from its ids, and no ":" or "~", which internal ids use).
TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_TENANT = "default"


def scoped_id(tenant: str, public_id: str) -> str:
    """The id under which a tenant's request or batch lives in Redis: ``tenant/id``, so that two
    tenants may use one id independently; the default tenant's ids are bare (caller ids have no
    ``/``, so the namespaces never meet)."""
    return public_id if not tenant or tenant == DEFAULT_TENANT else f"{tenant}/{public_id}"


def public_id(scoped: str) -> str:
    """The id the caller chose, from ``scoped_id``'s result."""
    return scoped.rpartition("/")[2]


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


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """What an engine yields: the text and tokens of one step for one request.

    The last delta of a stream has ``finish_reason`` set and ``prompt_tokens``
    filled in. ``text`` never ends inside a multi-byte character. It may also carry the engine's own
    timings of the request (name, milliseconds), which the worker logs with the job.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    engine_timings_ms: tuple[tuple[str, float], ...] = ()
    # Which of the request's n samples it belongs to; its finish_reason ends that sample only (the
    # stream ends after every sample ended, or at the first CANCELLED).
    sample: int = 0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    started_unix_ns: int = 0
    first_token_unix_ns: int = 0


@dataclass(frozen=True)
class Failure:
    """A failure as data: what crosses Redis instead of an exception."""

    code: str
    message: str
    retryable: bool = False
    field: str = ""


@dataclass(frozen=True)
class JobEvent:
    """One entry of a request's event stream (token deltas of one engine step).

    At most one of ``finished`` / ``failed`` is set, on the last event only.
    ``tokenized`` marks the last event of a tokenize job. With n > 1 samples, ``sample`` says whose
    tokens these are (``index`` counts within that sample), and ``sample_end`` ends a sample that is
    not the last one to end; the terminal event's ``finished`` ends the last one (its sample) and
    counts every sample's tokens.

    ``marks`` keeps, for events joined into this one (``then``, ``joined``), where each but the
    last ended: (tokens, characters of ``text``) so far. It lets a reader cut the event at any of
    those token counts with the text that goes with each side (``text_before``). It does not cross
    Redis: a worker's event is one engine step (or what its writer merged), and a caller's count of
    tokens received always falls on such a boundary.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    finished: Finished | None = None
    failed: Failure | None = None
    tokenized: bool = False
    worker: str = ""
    sample: int = 0
    sample_end: FinishReason | None = None
    marks: tuple[tuple[int, int], ...] = ()

    @property
    def terminal(self) -> bool:
        return self.finished is not None or self.failed is not None or self.tokenized

    @property
    def ends_sample(self) -> FinishReason | None:
        """How this event ends its sample, if it does."""
        if self.sample_end is not None:
            return self.sample_end
        return self.finished.finish_reason if self.finished is not None else None

    def follows_on(self, later: JobEvent) -> bool:
        """``later`` (of the same sample, this one not ending it) starts where this event's tokens
        end (or carries none): the two can be one."""
        if later.sample != self.sample or self.sample_end is not None:
            return False
        return not later.token_ids or later.index == self.index + len(self.token_ids)

    def then(self, later: JobEvent) -> JobEvent:
        """This event and the next one of the same request as one: the deltas joined, the ending (if
        any) and worker of ``later``, the index of this one. ``later`` must follow on (ValueError)."""
        return JobEvent.joined((self, later))

    @staticmethod
    def joined(events: Sequence[JobEvent]) -> JobEvent:
        """Events of one request, each following on the one before, as one (``then`` over all of
        them, in one pass rather than one copy per event). ValueError if one does not follow on."""
        first, last = events[0], events[-1]
        if len(events) == 1:
            return first
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        marks: list[tuple[int, int]] = []
        chars = 0
        for i, ev in enumerate(events):
            if i:
                prev = events[i - 1]
                if not prev.follows_on(ev):
                    end = prev.index + len(prev.token_ids)
                    raise ValueError(f"an event at token {ev.index} does not follow on one that ends at {end}")
                marks.append((len(ids), chars))
            marks.extend((len(ids) + t, chars + c) for t, c in ev.marks)
            texts.append(ev.text)
            chars += len(ev.text)
            ids.extend(ev.token_ids)
            logprobs.extend(ev.logprobs)
        return replace(last, text="".join(texts), token_ids=tuple(ids), logprobs=tuple(logprobs),
                       index=first.index, marks=tuple(marks))  # fmt: skip

    def text_before(self, k: int) -> int:
        """How many characters of ``text`` go with the first ``k`` of ``token_ids``: the text of the
        joined events whose tokens all lie among them (``marks``). Text with no token of its own (a
        final flush) goes with what follows it, and an engine step's text with its last token, so
        the two sides of any cut add up to the whole text."""
        if k >= len(self.token_ids) and not self.marks:
            return len(self.text) if k else 0
        best_t = chars = 0
        for t, c in (*self.marks, (len(self.token_ids), len(self.text))):
            if t > k:
                break
            if t > best_t:
                best_t, chars = t, c
        return chars


@dataclass(frozen=True)
class ModelInfo:
    id: str
    pool: str
    default: bool = False
    # A LoRA adapter of base model ``base`` (its id is "base:adapter"); empty for a base model.
    adapter: str = ""
    base: str = ""


# Adapter names (a worker's LLAMAMESH_WORKER_ADAPTERS, GenerateRequest.adapter): no ":" (it separates
# a model from its adapter) and nothing a path or a key would trip on.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class WorkerState(str, enum.Enum):
    """Where a worker is in its life, as its heartbeat says."""

    # The process is up, its engine is not ready yet (``WorkerStatus.detail`` says what it is doing:
    # converting, loading, compiling). Gateways treat its pool as coming up: requests wait.
    STARTING = "starting"
    # Its engine serves; it leases jobs.
    READY = "ready"
    # Its engine could not start, or died (``detail`` says why). It serves nothing; its supervisor
    # may start it again.
    FAILED = "failed"


@dataclass(frozen=True)
class WorkerStatus:
    """What a worker's heartbeat says about it (kept in Redis for a TTL; gone means dead)."""

    worker: str
    pool: str
    model: str = ""
    engine: str = ""
    inflight: int = 0
    max_inflight: int = 0
    # The engine's own figures (vLLM's scheduler; our CPU engine's batch).
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    # READY for heartbeats of workers that predate the field.
    state: str = WorkerState.READY.value
    # STARTING: what the engine's start is doing; FAILED: why it failed (one line).
    detail: str = ""
    # The LoRA adapters its engine serves (names), and the run-time ones it could not load
    # ("name=path: why").
    adapters: tuple[str, ...] = ()
    adapter_errors: tuple[str, ...] = ()
    # The run-time adapters it loaded, as "name=path" (LoadAdapter waits for the path it asked for).
    adapter_paths: tuple[str, ...] = ()
    # Wall clock (Unix s) when the state (or, while starting, the detail) began.
    since_unix_s: float = 0.0

    @property
    def ready(self) -> bool:
        return self.state == WorkerState.READY.value

    @property
    def starting(self) -> bool:
        return self.state == WorkerState.STARTING.value

    @property
    def failed(self) -> bool:
        return self.state == WorkerState.FAILED.value


class BatchState(str, enum.Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED)


class ItemStatus(str, enum.Enum):
    SUCCEEDED = "succeeded"
    ERRORED = "errored"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


@dataclass(frozen=True)
class ItemResult:
    """One batch item's outcome: exactly one per custom_id."""

    custom_id: str
    status: ItemStatus
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage = Usage(0, 0)
    error_code: str = ""
    error_message: str = ""
    # An item with n > 1 samples: each sample's (text, finish reason), in order; ``text`` and
    # ``finish_reason`` are sample 0's, ``usage`` counts them all. Empty for n = 1.
    samples: tuple[tuple[str, FinishReason | None], ...] = ()

    @classmethod
    def unrun(cls, custom_id: str, status: ItemStatus, why: str) -> ItemResult:
        """The result of an item that never ran (cancelled or expired), with ``why``."""
        return cls(custom_id, status, error_code=status.value, error_message=why)


@dataclass(frozen=True)
class BatchInfo:
    """A batch as stored: its state, counts (processing = total - the rest) and the Unix time
    (seconds) it entered each state (``times``, keyed by BatchState value)."""

    batch_id: str
    state: BatchState
    owner: str
    model: str
    total: int
    completion_window_s: int
    created_at: float
    expires_at: float
    succeeded: int = 0
    errored: int = 0
    cancelled: int = 0
    expired: int = 0
    times: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    results_expire_at: float = 0.0
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def processing(self) -> int:
        return self.total - self.succeeded - self.errored - self.cancelled - self.expired
