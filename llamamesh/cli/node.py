"""A whole node on one machine (``llamamesh serve`` and ``demo``): Redis (embedded Valkey unless a URL
is set), the gateway process and worker processes, under one supervisor (llamamesh/supervisor.py).

The gateway and the embedded Redis are essential: if either ends, the node stops. A worker that exits
is restarted with backoff, its exit written into its heartbeat (``failed``, why, when it restarts) so
that gateways and ``ListBackends`` say why the pool is short, crash-looping included. The children
are ``python -m services`` and ``python -m workers`` configured through ``Settings.to_env``, so the
core never imports either side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import grpc
import structlog
from grpc_health.v1 import health_pb2

from llamamesh import metrics
from llamamesh.cli.embedded import EmbeddedRedis
from llamamesh.cli.progress import Progress
from llamamesh.client import Client
from llamamesh.errors import QueueRefused, QueueUnavailable
from llamamesh.ports import check_free, free_port
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings, Settings, prometheus_multiproc_dir
from llamamesh.settings.environment import redacted_url
from llamamesh.supervisor import Child, ChildState, Supervisor
from llamamesh.types import WorkerState, WorkerStatus

log = structlog.get_logger(__name__)

# Between a worker's own reason for failing and what the supervisor adds (its exit, the restart).
NOTE = " · "


class StartFailed(Exception):
    """The node did not come up; the message is one line saying why. ``said``: the process that ended
    wrote its own ``error:`` line on the node's terminal (it exited 1, as each does at a setting or
    a resource it cannot use)."""

    def __init__(self, message: str, said: bool = False) -> None:
        super().__init__(message)
        self.said = said


@dataclass(frozen=True)
class WorkerView:
    """One of the node's workers as the gateway sees it."""

    name: str
    state: str
    detail: str
    since_unix_s: float


# What gRPC's handshake error says when the gateway's certificate is not trusted, or not for its address.
UNTRUSTED = ("CERTIFICATE_VERIFY_FAILED", "not in peer certificate", "Peer name")

METRICS_HOST = "LLAMAMESH_WORKER_METRICS_HOST"
# The HTTP door of an embedded node, where it is free (the port OpenAI-compatible servers use).
HTTP_PORT = 8000


class Node:
    """One machine's node: ``start``, ``wait_ready``, then ``wait`` (supervise) and ``stop``."""

    def __init__(self, settings: Settings, workers: int = 1, log_file: Path | None = None) -> None:
        self.settings = settings
        self._n_workers = workers
        self._log_file = log_file
        self._embedded: EmbeddedRedis | None = None
        self._log_handle: IO[bytes] | None = None
        self.supervisor: Supervisor | None = None
        self._metrics: metrics.Aggregate | None = None
        # Stable consumer names: a restarted worker takes its own leased jobs first and replaces
        # its own heartbeat.
        base = settings.worker.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.worker_names = [f"{base}-w{i}" for i in range(workers)]

    @property
    def address(self) -> str:
        g = self.settings.gateway
        return f"{g.host}:{g.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible HTTP door's base URL ("" when it is off)."""
        g = self.settings.gateway
        scheme = "https" if g.tls_cert else "http"
        return f"{scheme}://{g.host}:{g.http_port}/v1" if g.http_port else ""

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where the gateway's and the workers' /metrics are (empty before start)."""
        g, w = self.settings.gateway, self.settings.worker
        out = {}
        if g.metrics_port:
            out["gateway"] = f"http://{g.host}:{g.metrics_port}/metrics"
        if w.metrics_port:
            out["workers"] = f"http://{w.metrics_host}:{w.metrics_port}/metrics"
        return out

    def client(self) -> Client:
        """A client of the node's gateway with the client settings (LLAMAMESH_CLIENT_*: API key, CA,
        certificate), over TLS when the gateway speaks it."""
        return Client.from_settings(self.address, self.settings.client, tls=bool(self.settings.gateway.tls_cert))

    def start(self) -> None:
        """Start Redis (if embedded), the gateway and the workers. Raises if one cannot start."""
        if self.settings.gateway.tls_client_ca and not self.settings.client.tls_cert:
            raise StartFailed(
                "the gateway asks clients for a certificate (LLAMAMESH_GATEWAY_TLS_CLIENT_CA): set "
                "LLAMAMESH_CLIENT_TLS_CERT and LLAMAMESH_CLIENT_TLS_KEY so the node can watch it start"
            )
        if self.settings.redis.url:
            try:
                self.settings.redis.check_tls()
            except ValueError as exc:
                raise StartFailed(str(exc)) from None
            with concurrent.futures.ThreadPoolExecutor(1) as one:  # (start may be called in an event loop)
                one.submit(asyncio.run, _refused(self.settings.redis)).result()
        g = self.settings.gateway
        for setting, port in (("LLAMAMESH_GATEWAY_PORT", g.port), ("LLAMAMESH_GATEWAY_HEALTH_PORT", g.health_port)):
            check_free(g.host, port, setting, reuse_port=g.share_port)
        self._check_worker_health_ports()
        if not self.settings.redis.url:
            self._embedded = EmbeddedRedis(self.settings.redis.embedded_dir)
            url = self._embedded.start()
            self.settings = replace(self.settings, redis=replace(self.settings.redis, url=url))
        # Metrics on: the gateway serves its own (all its processes'), this process the workers'
        # (they write into one directory); a port left 0 is a free one.
        g, w = self.settings.gateway, self.settings.worker
        self.settings = self.settings.with_overrides(
            gateway={
                "metrics_port": g.metrics_port or free_port(g.host),
                "http_port": g.http_port or free_port(g.host, HTTP_PORT),
            },
            worker={"metrics_port": w.metrics_port or free_port(w.metrics_host)},
        )
        w = self.settings.worker
        self._metrics = metrics.Aggregate(w.metrics_port, w.metrics_host, "worker", prometheus_multiproc_dir())
        env = self.settings.to_env()
        worker_env = {**env, "LLAMAMESH_WORKER_METRICS_PORT": "0", **self._metrics.children_env()}
        if self._log_file is not None:
            self._log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = self._log_file.open("ab")
        children = [Child("gateway", (sys.executable, "-m", "services"), env, essential=True)]
        children += [
            Child(f"worker-{i}", (sys.executable, "-m", "workers"), {**worker_env, **self._worker_env(i, name)})
            for i, name in enumerate(self.worker_names)
        ]
        self.supervisor = Supervisor(children, output=self._log_handle, on_exit=self._worker_exited)
        self.supervisor.start()
        if self._embedded is not None and self._embedded.process is not None:
            self.supervisor.watch("redis", self._embedded.process)
        log.info(
            "node_started",
            address=self.address,
            http=self.http_url,
            redis=redacted_url(self.settings.redis.url),
            workers=self._n_workers,
            metrics=self.metrics_urls,
        )

    def _check_worker_health_ports(self) -> None:
        w = self.settings.worker
        if w.health_port and w.health_port + self._n_workers - 1 > 65535:
            raise OSError(f"LLAMAMESH_WORKER_HEALTH_PORT: {self._n_workers} workers need ports up to 65535")
        for i in range(self._n_workers if w.health_port else 0):
            check_free(w.metrics_host, w.health_port + i, "LLAMAMESH_WORKER_HEALTH_PORT", host_setting=METRICS_HOST)

    def _worker_env(self, i: int, name: str) -> dict[str, str]:
        """Worker ``i``'s own settings: its consumer name, and its health port (the setting's port plus
        ``i``; none when the setting is 0)."""
        port = self.settings.worker.health_port
        return {"LLAMAMESH_WORKER_CONSUMER": name, "LLAMAMESH_WORKER_HEALTH_PORT": str(port + i if port else 0)}

    @property
    def health_urls(self) -> list[str]:
        """Each worker's HTTP health base URL (empty without LLAMAMESH_WORKER_HEALTH_PORT)."""
        w = self.settings.worker
        return [f"http://{w.metrics_host}:{w.health_port + i}" for i in range(self._n_workers)] if w.health_port else []

    def _worker_exited(self, state: ChildState) -> None:
        """Write the exit into the worker's heartbeat (keeping the reason it gave, if it failed to
        start), for as long as it waits to restart."""
        if self._metrics is not None and state.name.startswith("worker-"):
            self._metrics.process_dead(state.pid)
        if not state.name.startswith("worker-") or state.restart_at is None:
            return
        name = self.worker_names[int(state.name.removeprefix("worker-"))]
        wait_s = max(0.0, state.restart_at - time.monotonic())
        note = f"its process exited with code {state.last_exit}; restarting in {wait_s:.0f} s"
        if state.crash_looping:
            note = f"crash-looping ({state.quick_exits} quick exits in a row): {note}"
        # A thread of its own: this runs inside wait_ready's event loop too. Bounded by the 2-s timeouts.
        t = threading.Thread(target=asyncio.run, args=(self._note_exit(name, note, wait_s + 30),), daemon=True)
        t.start()
        t.join(10)

    async def _note_exit(self, name: str, note: str, ttl_s: float) -> None:
        ws = self.settings.worker
        queue = RedisQueue.from_settings(self.settings.redis)
        try:
            seen = {w.worker: w for w in await asyncio.wait_for(queue.workers(ws.pool), 2)}.get(name)
            base = seen or WorkerStatus(worker=name, pool=ws.pool, model=ws.model, engine=ws.engine)
            # The reason a worker gave for failing stays first; an earlier note of ours is replaced.
            why = base.detail.split(NOTE)[0] if base.failed and base.detail else ""
            detail = f"{why}{NOTE}{note}" if why else note
            failed = replace(base, state=WorkerState.FAILED.value, detail=detail, since_unix_s=time.time())
            await asyncio.wait_for(queue.heartbeat(failed, ttl_s), 2)
        except (QueueUnavailable, asyncio.TimeoutError):
            log.warning("worker_exit_not_reported", worker=name)
        finally:
            await queue.close()

    def poll(self) -> int | None:
        """Reap and restart children once; the node's exit code if an essential one ended, else None."""
        assert self.supervisor is not None, "start() first"
        return self.supervisor.step()

    def wait(self) -> int:
        """Supervise until SIGTERM/SIGINT (0) or until the gateway or the embedded Redis ends (its
        code); workers that exit meanwhile are restarted."""
        assert self.supervisor is not None, "start() first"
        return self.supervisor.run()

    async def workers(self, queue: RedisQueue) -> list[WorkerView] | None:
        """The node's workers as their heartbeats say; None while Redis does not answer. Raises StartFailed when
        Redis refuses what the queue needs."""
        try:
            seen = {w.worker: w for w in await asyncio.wait_for(queue.workers(self.settings.worker.pool), 2)}
        except QueueRefused as exc:  # at once: a password, a permission, the database, TLS
            raise StartFailed(exc.reason) from exc
        except (QueueUnavailable, asyncio.TimeoutError):
            return None
        out = []
        for name in self.worker_names:
            w = seen.get(name)
            out.append(WorkerView(name, w.state, w.detail, w.since_unix_s) if w else WorkerView(name, "", "", 0.0))
        return out

    @staticmethod
    async def gateway_serving(client: Client) -> bool:
        """Whether the gateway answers its health check with SERVING."""
        try:
            return bool(await client.health() == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError as exc:
            if any(sign in (exc.details() or "") for sign in UNTRUSTED):
                raise StartFailed(
                    "the gateway's certificate (LLAMAMESH_GATEWAY_TLS_CERT) does not verify: set "
                    "LLAMAMESH_CLIENT_TLS_CA to the CA that signed it (and LLAMAMESH_CLIENT_TLS_SERVER_NAME to a "
                    "name it holds)"
                ) from exc
            return False

    async def wait_ready(
        self, out: IO[str] | None = None, timeout_s: float | None = None, events: bool = False
    ) -> float:
        """Wait until every worker of the node is ready, showing what they are doing on ``out`` (one
        updating line on a terminal, a line per step otherwise; with ``events``, log events instead:
        ``node_starting`` per step, ``node_status`` per line of the ready summary); returns the
        seconds it took. The workers' start is followed in their heartbeats, the gateway's through its
        health service (which needs no API key; with mutual TLS, the client certificate of
        LLAMAMESH_CLIENT_TLS_*).
        Raises StartFailed with a one-line reason when a worker could not start (its own reason), an
        essential process ended, or ``timeout_s`` (default: the worker start timeout) passed."""
        t0 = time.monotonic()
        limit = timeout_s if timeout_s is not None else self.settings.worker.start_timeout_s + 60
        # One line rewritten in place only when the children's logs do not share the terminal.
        show = Progress(out, t0, inline=self._log_file is not None, events=events)
        queue = RedisQueue.from_settings(self.settings.redis)
        async with self.client() as client:
            try:
                return await self._watch_start(client, queue, show, t0, limit)
            finally:
                await queue.close()

    async def _watch_start(self, client: Client, queue: RedisQueue, show: Progress, t0: float, limit: float) -> float:
        """wait_ready's loop: every 0.25 s, the children, the gateway's health, the workers' heartbeats."""
        serving = False
        answered = False  # Redis answered once: later silences are waited out up to ``limit``
        while True:
            code = self.poll()
            if code is not None:
                said = code == 1 and self._log_file is None
                raise StartFailed(f"the node's {self._ended()} ended (exit code {code}) while starting", said)
            serving = serving or await self.gateway_serving(client)
            heard = await self.workers(queue)  # None: Redis does not answer
            views = heard if serving else None
            if views is not None and all(v.state == WorkerState.READY.value for v in views):
                show.done(f"ready: {len(views)} worker(s) serving on {self.address}")
                show.done(f"OpenAI-compatible HTTP: {self.http_url}")
                for role, url in self.metrics_urls.items():
                    show.done(f"metrics ({role}): {url}")
                for i, url in enumerate(self.health_urls):
                    show.done(f"health (worker-{i}): {url}/readyz")
                return time.monotonic() - t0
            for v in views or ():
                if v.state == WorkerState.FAILED.value:
                    show.done("")
                    why = v.detail.split(NOTE)[0] if v.detail else "its process exited"
                    raise StartFailed(f"{v.name} could not start: {why}")
            answered = answered or heard is not None
            if heard is None:
                where = "the embedded Valkey" if self._embedded is not None else "Redis (LLAMAMESH_REDIS_URL)"
                wait_s = self.settings.redis.start_wait_s
                if not answered and time.monotonic() - t0 > wait_s:
                    show.done("")
                    raise StartFailed(f"{where} did not answer within {wait_s:g} s (LLAMAMESH_REDIS_START_WAIT_S)")
                show.update(f"{_doing(views)}: {where} does not answer yet", f"{_doing(views, took=False)}: no Redis")
            else:
                show.update(_doing(views), _doing(views, took=False))
            if time.monotonic() - t0 > limit:
                show.done("")
                raise StartFailed(f"the node was not ready within {limit:.0f} s: {_doing(views)}")
            await asyncio.sleep(0.25)

    def _ended(self) -> str:
        assert self.supervisor is not None
        ended = [s.name for s in self.supervisor.states.values() if s.child.essential and s.last_exit is not None]
        return ended[0] if ended else "gateway"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the gateway, then (once it drained) the workers, killing what outlives ``timeout_s``
        at each step; then stop Redis. A signal meanwhile goes on to the children (Supervisor.stop),
        never ends the node before them."""
        started = self.supervisor is not None or self._embedded is not None
        with self.supervisor.forwarding([]) if self.supervisor is not None else contextlib.nullcontext():
            if self.supervisor is not None:
                self.supervisor.stop(timeout_s, first=("gateway",))  # its workers run what it accepts meanwhile
                self.supervisor = None
            if self._embedded is not None:
                self._embedded.stop()
                self._embedded = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if started:
            log.info("node_stopped")


async def _refused(settings: RedisSettings) -> None:
    """Raise StartFailed when Redis refuses what the queue needs (before any process starts)."""
    queue = RedisQueue.from_settings(settings)
    try:
        if refusal := await queue.refused():
            raise StartFailed(refusal.reason)
    finally:
        await queue.close()


def _doing(views: list[WorkerView] | None, took: bool = True) -> str:
    """What the workers are doing; ``took``: with how long each has been at it."""
    if views is None:
        return "starting the gateway"
    now = time.time()
    parts = []
    for v in views:
        since = f" ({now - v.since_unix_s:.0f} s)" if took and v.since_unix_s else ""
        parts.append(f"{v.name}: {v.detail or v.state or 'starting its process'}{since}")
    return "; ".join(parts)
