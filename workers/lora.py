"""A worker's run-time LoRA adapters: the pool's list (AdminService LoadAdapter / UnloadAdapter), loaded
into and unloaded from its engine beside the heartbeat; the engine's own adapters
(``LLAMAMESH_WORKER_ADAPTERS``) are left alone."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import structlog

from llamamesh.errors import FailedPrecondition, LlamameshError, PermissionDenied, QueueUnavailable
from llamamesh.queue.protocol import WorkQueue
from llamamesh.settings import WorkerSettings, adapter_table
from llamamesh.types import WorkerState
from workers.engines.base import Engine
from workers.life import Life

log = structlog.get_logger(__name__)


class LoraAdapters:
    """What was loaded at run time (name -> path) and what failed to ((name, path) -> why)."""

    def __init__(self, settings: WorkerSettings, queue: WorkQueue, engine: Engine, life: Life) -> None:
        self._s = settings
        self._queue = queue
        self._engine = engine
        self._life = life
        self._own = frozenset(adapter_table(settings.adapters))
        self.loaded: dict[str, str] = {}
        self.errors: dict[tuple[str, str], str] = {}

    async def sync_quietly(self) -> None:
        with contextlib.suppress(QueueUnavailable):  # the heartbeat's own line says Redis is out
            await self.sync()

    async def sync(self) -> None:
        """Load the pool's run-time adapters this worker does not have yet, unload those dropped; one
        that fails to load is not tried again from the same path (its heartbeat says why). Engines
        without run-time adapters, and a worker not ready, do nothing."""
        if self._life.state is not WorkerState.READY or not hasattr(self._engine, "load_adapter"):
            return
        engine: Any = self._engine
        wanted = await self._queue.adapters(self._s.pool)
        for name, path in wanted.items():
            if self.loaded.get(name) == path or name in self._own or (name, path) in self.errors:
                continue
            if name in self.loaded:  # registered again from another folder: swap it
                try:
                    await engine.unload_adapter(name)
                except FailedPrecondition:
                    continue  # its requests first
                del self.loaded[name]
            await self._load(engine, name, path)
        for name in [n for n in self.loaded if n not in wanted]:
            try:
                await engine.unload_adapter(name)
            except FailedPrecondition as exc:  # requests still use it: the next heartbeat tries again
                log.info("adapter_unload_waits", adapter=name, why=exc.message)
                continue
            del self.loaded[name]
            log.info("adapter_unloaded", adapter=name)
        self.errors = {k: v for k, v in self.errors.items() if wanted.get(k[0]) == k[1]}

    async def _load(self, engine: Any, name: str, path: str) -> None:
        try:
            self._check_root(path)
            await engine.load_adapter(name, path)
        except Exception as exc:
            why = exc.message if isinstance(exc, LlamameshError) else f"{type(exc).__name__}: {exc}"
            self.errors[(name, path)] = why
            log.warning("adapter_load_failed", adapter=name, path=path, error=why)
            return
        self.loaded[name] = path
        log.info("adapter_loaded", adapter=name, path=path)

    def _check_root(self, path: str) -> None:
        """PermissionDenied for a run-time adapter outside LLAMAMESH_WORKER_ADAPTER_ROOT (when set)."""
        if not self._s.adapter_root:
            return
        root = Path(self._s.adapter_root).expanduser().resolve()
        if not Path(path).expanduser().resolve().is_relative_to(root):
            raise PermissionDenied(f"{path!r} is not under LLAMAMESH_WORKER_ADAPTER_ROOT")
