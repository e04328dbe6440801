"""Plain domain types shared by the gateway, the queue layer and the workers, one module per owner:
``requests`` (what a caller asks for), ``events`` (what generation yields), ``batches``, ``workers``
(pools, models and heartbeats) and ``names`` (tenant and adapter names, scoped ids). Every name is
importable from here."""

from llamamesh.types.batches import BatchInfo, BatchState, ItemResult, ItemStatus, StoredFile
from llamamesh.types.events import (
    Failure,
    Finished,
    FinishReason,
    JobEvent,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from llamamesh.types.names import (
    ADAPTER_NAME,
    DEFAULT_TENANT,
    PROBE_TENANT,
    TENANT_NAME,
    public_id,
    scoped_id,
    tenant_salt,
)
from llamamesh.types.requests import (
    CHAT_ROLES,
    MAX_PREFIX_KEY_CHARS,
    Attempt,
    ChatMessage,
    ConstraintKind,
    GenerationRequest,
    JobKind,
    ResponseConstraint,
    SamplingParams,
    affinity_key,
)
from llamamesh.types.workers import ModelInfo, WorkerState, WorkerStatus

__all__ = [
    "ADAPTER_NAME",
    "CHAT_ROLES",
    "DEFAULT_TENANT",
    "MAX_PREFIX_KEY_CHARS",
    "PROBE_TENANT",
    "TENANT_NAME",
    "Attempt",
    "BatchInfo",
    "BatchState",
    "ChatMessage",
    "ConstraintKind",
    "Failure",
    "FinishReason",
    "Finished",
    "GenerationRequest",
    "ItemResult",
    "ItemStatus",
    "JobEvent",
    "JobKind",
    "ModelInfo",
    "ResponseConstraint",
    "SamplingParams",
    "StoredFile",
    "TokenDelta",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "WorkerState",
    "WorkerStatus",
    "affinity_key",
    "public_id",
    "scoped_id",
    "tenant_salt",
]
