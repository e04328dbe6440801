"""The seam between a worker and an inference engine.

An engine adapter translates the library's errors into ``llamamesh.errors``
(bad sampling input -> ``InvalidRequest`` naming the field; a dead engine ->
``EngineDead``) and never imports redis or grpc.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from llamamesh.types import GenerationRequest, TokenDelta

# Request ids an engine keeps in its ``aborted`` (and the fake's ``served``) list: the most recent
# ones, for tests and logs; a worker that runs for days must not keep every one.
REMEMBERED_IDS = 1000


def remember(ids: list[str], request_id: str, keep: int = REMEMBERED_IDS) -> None:
    """Append ``request_id``, dropping the oldest once ``ids`` holds twice ``keep`` (amortised O(1))."""
    ids.append(request_id)
    if len(ids) > 2 * keep:
        del ids[:-keep]


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    # Fraction of the KV cache in use, 0..1.
    kv_cache_usage: float = 0.0
    # A counter that moves whenever the engine makes progress (steps run, or outputs delivered);
    # the worker's watchdog takes an engine with work in flight and a still counter for wedged.
    # -1: the engine does not count.
    steps: int = -1


class Engine(Protocol):
    """One loaded model, serving many requests at once."""

    @property
    def model_name(self) -> str: ...

    async def start(self) -> None:
        """Load the model (idempotent). Raises EngineDead if it cannot, or InvalidRequest naming the
        setting at fault."""

    @property
    def starting(self) -> str:
        """While :meth:`start` runs: what it is doing, one short line for operators ("converting the
        GGUF model"); "" otherwise."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Generate for one request, one delta per engine step.

        The last delta has ``finish_reason`` and ``prompt_tokens`` set. Invalid
        sampling input raises InvalidRequest before any delta. Cancelling the
        consuming task aborts the request in the engine.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request; its stream ends with finish_reason CANCELLED."""

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """The token ids the engine would feed the model for this request's input."""
        ...

    async def check_health(self) -> None:
        """Raise EngineDead if the engine can no longer serve."""

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None:
        """Release the model; pending streams end."""
