"""Durable batches as stored: a batch's state and counts, and each item's result."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from llamamesh.types.events import FinishReason, TokenLogprob, Usage


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
    usage: Usage = Usage(0, 0)  # noqa: RUF009 (Usage is frozen: one shared default is safe)
    error_code: str = ""
    error_message: str = ""
    error_field: str = ""  # a client error's field at fault (the first), as the gateway's request names it
    # An item with n > 1 samples: each sample's (text, finish reason), in order; ``text`` and
    # ``finish_reason`` are sample 0's, ``usage`` counts them all. Empty for n = 1.
    samples: tuple[tuple[str, FinishReason | None], ...] = ()
    # The request asked for logprobs: each sample's, a token each, in order (empty when not asked).
    logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()

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
    # The tokens of the items recorded so far (each item once, every sample of it).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def processing(self) -> int:
        return self.total - self.succeeded - self.errored - self.cancelled - self.expired


@dataclass(frozen=True)
class StoredFile:
    """A file a tenant uploaded (the OpenAI-compatible door's ``/v1/files``: a batch's input)."""

    file_id: str
    owner: str
    filename: str
    purpose: str
    size: int  # bytes
    created_at: float


def batch_at_risk(info: BatchInfo, now: float, fraction: float) -> bool:
    """An open (not cancelling) batch with unfinished items, before its deadline, with less than
    ``fraction`` of its completion window left (``llamamesh_batches_at_risk``)."""
    if info.state.ended or info.state is BatchState.CANCELLING or info.processing <= 0:
        return False
    left = info.expires_at - now
    return 0 < left < fraction * info.completion_window_s


def projected_finish(info: BatchInfo, now: float) -> float | None:
    """When (Unix s) an open batch's unfinished items will have ended, at the rate its items have
    ended since it was created; None: ended, cancelling, or no item ended yet. A batch projected past
    its ``expires_at`` is late (``llamamesh_batches_projected_late``): items not started by then end
    expired."""
    if info.state.ended or info.state is BatchState.CANCELLING or info.processing <= 0:
        return None
    done = info.total - info.processing
    if done <= 0:
        return None
    return now + info.processing * max(now - info.created_at, 1e-3) / done
