"""Engine names -> factories. Engine modules are imported only when chosen, so a
worker image without vLLM or TensorRT-LLM (or without torch) still starts the others."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from llamamesh.errors import InvalidRequest
from llamamesh.settings import WorkerSettings
from workers.engines.base import Engine

# name -> "module:factory"; the factory takes WorkerSettings.
ENGINES: dict[str, str] = {
    "fake": "workers.engines.fake:FakeEngine",
    "transformers": "workers.engines.transformers:TransformersEngine",
}


def create(settings: WorkerSettings) -> Engine:
    """Import the engine module named by ``settings.engine`` and build the engine (not started)."""
    try:
        target = ENGINES[settings.engine]
    except KeyError:
        raise InvalidRequest.field(
            "worker.engine", f"unknown engine {settings.engine!r}; known: {', '.join(sorted(ENGINES))}"
        ) from None
    module_name, _, attr = target.partition(":")
    factory: Callable[[WorkerSettings], Engine] = getattr(importlib.import_module(module_name), attr)
    return factory(settings)
