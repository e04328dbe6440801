"""Engine names -> factories. Engine modules are imported only when chosen, so a
worker image without vLLM or TensorRT-LLM (or without torch) still starts the others."""

from __future__ import annotations

from collections.abc import Callable

from llamamesh.errors import InvalidRequest
from llamamesh.settings import Settings
from workers.engines.base import Engine


def _fake(settings: Settings) -> Engine:
    from workers.engines.fake import FakeEngine

    return FakeEngine(settings.worker)


def _transformers(settings: Settings) -> Engine:
    from workers.engines.transformers import TransformersEngine

    return TransformersEngine(settings.worker)


def _vllm(settings: Settings) -> Engine:
    from workers.engines.vllm import VllmEngine, for_worker

    return VllmEngine(settings.worker, for_worker(settings.vllm, settings.batch))


def _trtllm(settings: Settings) -> Engine:
    from workers.engines.trtllm import TrtllmEngine

    return TrtllmEngine(settings.worker, settings.trtllm)


# name -> factory; each takes the whole Settings and picks the sections its engine reads.
ENGINES: dict[str, Callable[[Settings], Engine]] = {
    "fake": _fake,
    "transformers": _transformers,
    "vllm": _vllm,
    "trtllm": _trtllm,
}


def create(settings: Settings) -> Engine:
    """Import the engine module named by ``settings.worker.engine`` and build the engine (not started)."""
    name = settings.worker.engine
    try:
        factory = ENGINES[name]
    except KeyError:
        raise InvalidRequest.field(
            "worker.engine", f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}"
        ) from None
    return factory(settings)
