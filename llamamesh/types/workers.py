"""What the pools serve and what a worker's heartbeat says about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    id: str
    pool: str
    default: bool = False
    # A LoRA adapter of base model ``base`` (its id is "base:adapter"); empty for a base model.
    adapter: str = ""
    base: str = ""


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
