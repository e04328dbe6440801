"""Every engine a worker can run, each described once: its name, the settings section it reads, how it
runs as processes, what compiles a response_format for it, and how to build it.

Adding an engine is its adapter module(s) here in engines/ and one entry in ENGINES; nothing else
names an engine. An adapter is imported only when its engine is built (a shared core's module only in
that process mode), so a worker image without vLLM, TensorRT-LLM or torch still runs the others.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llamamesh.errors import InvalidRequest
from llamamesh.settings import Settings, TrtllmSettings, VllmSettings
from workers.engines.base import Engine
from workers.engines.constraints import Grammars, trtllm_guided, vllm_structured

# A frontend process's entry point, as the shared core's process manager calls it in a spawned process:
# (listen address, socket, the settings given to SharedCore.run, the client's config).
Target = Callable[[str, Any, Any, dict[str, Any]], None]


class ProcessMode(enum.Enum):
    """How ``python -m workers`` runs an engine (workers/__main__.py)."""

    ONE_PROCESS = "one_process"  # one worker process (its engine may start processes of its own)
    FRONTENDS = "frontends"  # several worker processes, the frontends, sharing one engine core
    REPLICAS = "replicas"  # one worker process per group of GPUs, supervised by this one


class SharedCore(Protocol):
    """An engine core several frontend processes share (ProcessMode.FRONTENDS)."""

    def run(self, settings: Settings, target: Target, shutdown_timeout_s: float) -> int:
        """Start the core and ``frontends`` processes running ``target(..., settings, client_config)``;
        supervise them until SIGTERM/SIGINT (forwarded: they drain) or until one dies. Returns 0
        after a requested stop, 1 when a process died."""
        ...

    def place(self, client_config: dict[str, Any]) -> tuple[int, int]:
        """(frontends, this frontend's index), from the ``client_config`` its process was given."""
        ...

    def engine(self, settings: Settings, client_config: dict[str, Any], constraints: Any) -> Engine:
        """One frontend's engine over the core (``client_config`` as the process manager gave it,
        without the frontends' count and index)."""
        ...


@dataclass(frozen=True)
class EngineSpec:
    name: str
    # Imports the adapter and builds the engine (not started) from the settings and ``constraints``.
    build: Callable[[Settings, Any], Engine]
    # What compiles a request's response_format for it (None: checked, not followed).
    constraints: Any = None
    # The Settings section it reads beside ``worker`` (``Settings.<section>``), and that section's class.
    section: str = ""
    settings_class: type | None = None
    # The section's field with the GPUs one engine spans (0: every visible GPU): more GPUs than that,
    # and the worker runs one replica per group of them (ProcessMode.REPLICAS). "": CPU only.
    devices_field: str = ""
    # The section's field with its frontend processes over one engine core (ProcessMode.FRONTENDS),
    # and the loader of that core (imported only in that mode). "": one process always.
    frontends_field: str = ""
    shared_core: Callable[[], SharedCore] | None = None

    def section_of(self, settings: Settings) -> Any:
        return getattr(settings, self.section) if self.section else None

    def devices_per_engine(self, settings: Settings) -> int:
        """The GPUs one engine spans (0: every visible GPU, or a CPU engine)."""
        return int(getattr(self.section_of(settings), self.devices_field)) if self.devices_field else 0

    @property
    def devices_setting(self) -> str:
        """The ``section.field`` named by errors about the devices per engine."""
        return f"{self.section}.{self.devices_field}"

    def frontends(self, settings: Settings) -> int:
        return int(getattr(self.section_of(settings), self.frontends_field)) if self.frontends_field else 1

    def process_mode(self, settings: Settings, visible_gpus: Callable[[], Sequence[str]]) -> ProcessMode:
        """REPLICAS when one engine spans fewer GPUs than ``visible_gpus()`` lists (asked only then),
        else FRONTENDS when several frontends are set, else ONE_PROCESS."""
        per_engine = self.devices_per_engine(settings)
        if per_engine > 0 and len(visible_gpus()) > per_engine:
            return ProcessMode.REPLICAS
        if self.shared_core is not None and self.frontends(settings) > 1:
            return ProcessMode.FRONTENDS
        return ProcessMode.ONE_PROCESS


def _fake(settings: Settings, constraints: Any) -> Engine:
    from workers.engines.fake import FakeEngine

    return FakeEngine(settings.worker)


def _transformers(settings: Settings, constraints: Any) -> Engine:
    from workers.engines.transformers import TransformersEngine

    return TransformersEngine(settings.worker, constraints=constraints)


def _vllm(settings: Settings, constraints: Any) -> Engine:
    from workers.engines.vllm import VllmEngine
    from workers.engines.vllm_args import for_worker

    return VllmEngine(settings.worker, for_worker(settings.vllm, settings.batch), constraints=constraints)


def _vllm_core() -> SharedCore:
    from workers.engines.vllm_frontends import VllmCore

    return VllmCore()


def _trtllm(settings: Settings, constraints: Any) -> Engine:
    from workers.engines.trtllm import TrtllmEngine

    return TrtllmEngine(settings.worker, settings.trtllm, constraints=constraints)


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec("fake", _fake),
        EngineSpec("transformers", _transformers, constraints=Grammars),
        EngineSpec(
            "vllm",
            _vllm,
            constraints=vllm_structured,
            section="vllm",
            settings_class=VllmSettings,
            devices_field="tensor_parallel_size",
            frontends_field="frontends",
            shared_core=_vllm_core,
        ),
        EngineSpec(
            "trtllm",
            _trtllm,
            constraints=trtllm_guided,
            section="trtllm",
            settings_class=TrtllmSettings,
            devices_field="tensor_parallel_size",
        ),
    )
}


def spec_of(name: str) -> EngineSpec:
    """The registry's entry for ``name``; InvalidRequest on ``worker.engine`` for an unknown one."""
    try:
        return ENGINES[name]
    except KeyError:
        raise InvalidRequest.field(
            "worker.engine", f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}"
        ) from None


def create(settings: Settings) -> Engine:
    """Import the engine module named by ``settings.worker.engine`` and build the engine (not started)."""
    spec = spec_of(settings.worker.engine)
    return spec.build(settings, spec.constraints)
