"""One domain error tree. Imports neither grpc nor redis.

Each class has a stable ``code`` so that a failure can cross Redis as data
(``Failed{code, message, retryable, field}``) and be rebuilt on the other side
with :func:`from_code`. ``services/status.py`` maps the tree to gRPC once, and every status it
sends carries a ``google.rpc.ErrorInfo`` of domain ``ERROR_DOMAIN`` whose reason is the code in
capitals (``QUEUE_FULL``, ``NO_WORKERS``...), so that callers can tell the gateway's own statuses
apart, and apart from the transport's.
"""

from __future__ import annotations

from dataclasses import dataclass

ERROR_DOMAIN = "llamamesh.v1"


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class LlamameshError(Exception):
    """Base of every error llamamesh raises on purpose."""

    code = "internal"
    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --- client errors: the request is at fault; retrying the same request fails again.
class ClientError(LlamameshError):
    code = "client_error"


class InvalidRequest(ClientError):
    """One or more request fields are invalid; ``violations`` names each field."""

    code = "invalid_argument"

    def __init__(self, violations: list[FieldViolation] | FieldViolation) -> None:
        if isinstance(violations, FieldViolation):
            violations = [violations]
        self.violations = list(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    @classmethod
    def field(cls, field: str, description: str) -> InvalidRequest:
        return cls(FieldViolation(field, description))


class PromptTooLong(InvalidRequest):
    code = "prompt_too_long"


class NotFound(ClientError):
    code = "not_found"


class ModelNotFound(NotFound):
    """A model (or model:adapter) that no pool here serves: OpenAI's ``model_not_found``."""

    code = "model_not_found"


class OutOfRange(ClientError):
    """A position past the end: an Attach offset beyond the tokens the request produced."""

    code = "out_of_range"


class AlreadyExists(ClientError):
    """A caller-chosen id (request or batch) already names a different request."""

    code = "already_exists"


class FailedPrecondition(ClientError):
    """The request is fine but the system is not in the state it needs (e.g. unloading an adapter
    that requests still use)."""

    code = "failed_precondition"


class Unauthenticated(ClientError):
    """No valid identity: no API key or client certificate, or an unknown or revoked one."""

    code = "unauthenticated"


class PermissionDenied(ClientError):
    """An authenticated caller asked for what its tenant may not have (admin RPCs, a pool, a
    priority above its cap)."""

    code = "permission_denied"


# --- capacity: try again later.
class CapacityError(LlamameshError):
    code = "capacity"
    retryable = True

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(CapacityError):
    code = "queue_full"


class RateLimited(CapacityError):
    code = "rate_limited"


# --- unavailable: a dependency is down; another attempt may succeed.
class Unavailable(LlamameshError):
    code = "unavailable"
    retryable = True


class NoWorkers(Unavailable):
    code = "no_workers"


class QueueUnavailable(Unavailable):
    """Redis does not answer (or refuses writes). Callers get UNAVAILABLE with ``retry_after_s`` as
    RetryInfo: a failover or a restart takes seconds."""

    code = "queue_unavailable"
    retry_after_s = 1.0

    @property
    def detail(self) -> str:
        """What Redis, or the connection to it, said (for logs; callers get the message alone)."""
        cause = self.__cause__
        return f"{type(cause).__name__}: {cause}" if cause is not None else self.message


class QueueRefused(QueueUnavailable):
    """Redis answers but refuses this client: a password, an ACL permission, the database index, TLS's
    certificate, the protocol. Retrying does not mend it: a process refused at its start stops, naming
    ``reason`` (callers are told no more than that the queue is unreachable)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def detail(self) -> str:
        return self.reason


class QueueOutOfMemory(QueueUnavailable):
    """Redis answers but refuses writes: it reached its ``maxmemory`` (with the ``noeviction``
    policy a queue needs). Nothing of the refused call was kept. A kind of QueueUnavailable to the
    code that retries (workers, the gateway's loops); a capacity error to callers
    (RESOURCE_EXHAUSTED, with ``retry_after_s`` as RetryInfo)."""

    code = "queue_out_of_memory"

    def __init__(self, message: str, retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueMisconfigured(QueueUnavailable):
    """The pool is partitioned (prefix affinity) otherwise than this process is set up for: its
    gateways and workers disagree on LLAMAMESH_REDIS_AFFINITY_PARTITIONS."""

    code = "queue_misconfigured"


class EventsLost(QueueUnavailable):
    """Redis came back without some of a request's events (its last second of writes): the caller
    has tokens up to a point, the next events start past it."""

    code = "events_lost"


class RequestLost(QueueUnavailable):
    """Redis came back without its data, and this request (queued to the data before) with it: no
    call finds it again (an Attach is NOT_FOUND), so a client does not resume it; sent again under
    its id it runs as a new request."""

    code = "request_lost"


class EngineDead(Unavailable):
    code = "engine_dead"


class WorkerLost(Unavailable):
    """The request's worker went away. ``running``: it was running the request when it died (a
    crash, a lost heartbeat), as opposed to handing it back or never taking it."""

    code = "worker_lost"

    def __init__(self, message: str, running: bool = False) -> None:
        super().__init__(message)
        self.running = running


class WorkerDied(WorkerLost):
    """The worker that was running the request died (found by the worker that took its job over)."""

    code = "worker_died"

    def __init__(self, message: str, running: bool = True) -> None:
        super().__init__(message, running=True)


class DeadlineExceeded(LlamameshError):
    code = "deadline_exceeded"


class DeadlineUnreachable(DeadlineExceeded):
    """Refused before queueing: the caller's deadline is shorter than the pool's queue wait."""

    code = "deadline_unreachable"


class InternalError(LlamameshError):
    code = "internal"


class SetAside(InternalError):
    """A poison request: the workers that ran it kept dying, so it is not sent to another one; it
    is recorded in its pool's dead-letter stream. Its message is ours (no engine text), so the
    caller sees it."""

    code = "set_aside"


def _all_subclasses(cls: type[LlamameshError]) -> list[type[LlamameshError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[LlamameshError]] = {c.code: c for c in _all_subclasses(LlamameshError)}


def from_code(code: str, message: str, field: str = "") -> LlamameshError:
    """Rebuild a domain error from its wire form; unknown codes become InternalError. An
    InvalidRequest's message already names its field (``field: why``): the violation keeps the why."""
    cls = _BY_CODE.get(code, InternalError)
    if issubclass(cls, InvalidRequest):
        return cls(FieldViolation(field or "request", message.removeprefix(f"{field}: ") if field else message))
    return cls(message)


def field_of(exc: LlamameshError) -> str:
    """The request field at fault, or "" when the error is not about one field."""
    if isinstance(exc, InvalidRequest) and exc.violations:
        return exc.violations[0].field
    return ""
