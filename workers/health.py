"""A worker's HTTP health endpoint, for Kubernetes probes (workers serve no gRPC):
``LLAMAMESH_WORKER_HEALTH_PORT`` (0: off) on ``LLAMAMESH_WORKER_METRICS_HOST``, answering ``GET
/livez`` and ``GET /readyz`` (:class:`HealthServer`), for a worker or for a process supervising
several (:func:`supervisor_health`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog

from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import Settings
from llamamesh.types import WorkerState

log = structlog.get_logger(__name__)

# (alive, ready, what): the worker's view, read on each probe.
Probe = Callable[[], tuple[bool, bool, str]]


class HealthServer:
    """``GET /livez``: 200 while the process runs and its engine has not died (a dead or wedged engine
    ends the worker anyway; this says so while it shuts down), else 503. ``GET /readyz``: 200 while
    the worker leases jobs: its engine is up and it is not stopping; 503 while the engine starts
    (minutes for a cold GPU), after SIGTERM and after a failure. The body is one line: the worker's
    state and why. A thread of its own answers, so probes are answered while the event loop is busy
    importing torch or vLLM."""

    def __init__(self, port: int, host: str, probe: Probe) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                alive, ready, what = probe()
                ok = {"/livez": alive, "/readyz": ready}.get(self.path.split("?", 1)[0])
                if ok is None:
                    self._reply(404, "not found: /livez or /readyz")
                else:
                    self._reply(200 if ok else 503, what)

            def _reply(self, code: int, text: str) -> None:
                body = (text + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes every few seconds: not worth a log line each

        self._host = host
        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # a port taken, a host that is no address here: name the setting
            why = f"LLAMAMESH_WORKER_HEALTH_PORT: cannot serve health on {host}:{port}: {exc.strerror or exc}"
            raise OSError(exc.errno, why) from exc
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="worker-health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("worker_health_serving", url=f"http://{self._host}:{self.port}/readyz")
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def heartbeats_probe(settings: Settings, names: Sequence[str]) -> Probe:
    """The probe of a process supervising the workers ``names`` (vLLM frontends, GPU replicas): alive
    while it supervises (it restarts a child that dies itself); ready when every one of them says
    ``ready`` in its heartbeat (read from Redis on each probe)."""

    async def read() -> dict[str, str]:
        queue = RedisQueue.from_settings(settings.redis)
        try:
            return {w.worker: w.state for w in await queue.workers(settings.worker.pool)}
        finally:
            await queue.close()

    def probe() -> tuple[bool, bool, str]:
        try:
            states = asyncio.run(read())
        except Exception as exc:  # Redis out: not ready, still alive
            return True, False, f"cannot read the workers' heartbeats: {type(exc).__name__}: {exc}"
        ready = [n for n in names if states.get(n) == WorkerState.READY.value]
        rest = ", ".join(f"{n} {states.get(n, 'absent')}" for n in names if n not in ready)
        what = f"{len(ready)}/{len(names)} workers ready" + (f" ({rest})" if rest else "")
        return True, len(ready) == len(names), what

    return probe


def supervisor_health(settings: Settings, names: Sequence[str]) -> HealthServer | None:
    """The supervisor's health endpoint (its children serve none of their own), when configured."""
    ws = settings.worker
    if not ws.health_port:
        return None
    return HealthServer(ws.health_port, ws.metrics_host, heartbeats_probe(settings, names)).start()
