"""A whole node on one machine: Redis (embedded Valkey unless a URL is set), the gateway
process and CPU worker process(es), supervised together.

The gateway and workers run as child processes (``python -m services`` and
``python -m workers``), configured through the environment that
``Settings.to_env`` writes, so the core never imports either side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import IO

import structlog

from llamamesh.embedded import EmbeddedRedis
from llamamesh.settings import Settings

log = structlog.get_logger(__name__)


class Node:
    def __init__(self, settings: Settings, workers: int = 1, log_file: Path | None = None) -> None:
        self.settings = settings
        self._n_workers = workers
        self._log_file = log_file
        self._embedded: EmbeddedRedis | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_handle: IO[bytes] | None = None

    @property
    def address(self) -> str:
        g = self.settings.gateway
        return f"{g.host}:{g.port}"

    def start(self) -> None:
        """Start Redis (if embedded), the gateway and the workers. Raises if one cannot start."""
        if not self.settings.redis.url:
            self._embedded = EmbeddedRedis(self.settings.redis.embedded_dir)
            url = self._embedded.start()
            self.settings = replace(self.settings, redis=replace(self.settings.redis, url=url))
        env = {**os.environ, **self.settings.to_env()}
        out: IO[bytes] | None = None
        if self._log_file is not None:
            self._log_file.parent.mkdir(parents=True, exist_ok=True)
            out = self._log_handle = self._log_file.open("ab")
        self._procs["gateway"] = subprocess.Popen([sys.executable, "-m", "services"], env=env, stdout=out, stderr=out)
        for i in range(self._n_workers):
            self._procs[f"worker-{i}"] = subprocess.Popen(
                [sys.executable, "-m", "workers"], env=env, stdout=out, stderr=out
            )
        log.info("node_started", address=self.address, redis=self.settings.redis.url, workers=self._n_workers)

    def wait(self) -> int:
        """Block until a child exits or SIGTERM/SIGINT arrives; returns the exit code for the node."""
        stopping = False

        def _stop(signum: int, _frame: object) -> None:
            nonlocal stopping
            stopping = True

        old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not stopping:
                for name, p in self._procs.items():
                    if p.poll() is not None:
                        log.error("node_child_exited", child=name, exit_code=p.returncode)
                        return p.returncode or 1
                time.sleep(0.2)
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every child (they drain), kill what outlives ``timeout_s``, stop Redis."""
        for p in self._procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self._procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
        if self._log_handle is not None:
            self._log_handle.close()
        log.info("node_stopped")
