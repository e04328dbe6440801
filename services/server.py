"""The gateway process (``python -m services``): one gateway (services/gateway.py) until
SIGTERM/SIGINT (``serve``), or ``LLAMAMESH_GATEWAY_PROCESSES`` of them on one port under the
supervisor (``supervise``)."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import sys

import structlog

from llamamesh import logs, metrics, tracing
from llamamesh.loop import EVENT_LOOPS, run_main, serving_heap
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.files import RedisFiles
from llamamesh.queue.quotas import RedisQuotas
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import Settings, prometheus_multiproc_dir
from llamamesh.supervisor import Child, Supervisor
from services.gateway import Gateway, start_gateway
from services.normalize import Normalizer

# Names importers take from this module; services/gateway.py owns them.
__all__ = ["Gateway", "main", "serve", "start_gateway", "supervise"]

log = structlog.get_logger(__name__)


class StartFailed(Exception):
    """The gateway could not start (the message says why, in one line)."""


async def serve(settings: Settings, share_port: bool = False) -> None:
    """Run the gateway until SIGTERM/SIGINT, then settle (NOT_SERVING, still serving, for
    ``settle_s``; a second signal ends it), then drain open streams for ``grace_s``."""
    stop, again = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        (again if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    g = settings.gateway
    queue = RedisQueue.from_settings(settings.redis)
    batches = RedisBatches.from_settings(
        queue.client, queue.keys, settings.batch, replicas=queue.replicas, outage_grace_s=settings.redis.outage_grace_s
    )
    try:
        if refusal := await queue.refused():  # a password, a permission, the database, TLS: no retry mends it
            raise StartFailed(refusal.reason)
        metrics.serve(g.metrics_port, g.host, "gateway", prometheus_multiproc_dir())
        gateway = await start_gateway(
            queue,
            settings.gateway,
            share_port=share_port,
            breaker=settings.breaker,
            batches=batches,
            batch=settings.batch,
            auth=settings.auth,
            limits=settings.limits,
            quotas=RedisQuotas(queue.client, queue.keys, queue.retention),
            files=RedisFiles(queue.client, queue.keys),
        )
    except (ValueError, OSError, RuntimeError, StartFailed) as exc:  # a bad rule or file, a port taken, Redis
        await batches.close()
        await queue.close()
        if isinstance(exc, StartFailed):
            raise
        raise StartFailed(str(exc)) from exc
    log.info("heap_frozen", objects=serving_heap())
    try:
        await stop.wait()
        if g.settle_s > 0:
            # Health first: balancers and clients watching it move away while this one still serves.
            await gateway.health.shutdown()
            log.info("gateway_settling", settle_s=g.settle_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(again.wait(), g.settle_s)
    finally:
        log.info("gateway_stopping", grace_s=settings.gateway.grace_s)
        await gateway.stop(settings.gateway.grace_s)
        await batches.close()
        await queue.close()
        log.info("gateway_stopped")


def supervise(settings: Settings) -> int:
    """Run ``gateway.processes`` gateway processes on one port (SO_REUSEPORT) under the supervisor
    (llamamesh/supervisor.py) until SIGTERM/SIGINT, forwarded (each drains). A process that dies is
    started again with backoff while the others go on serving. Returns 0, or 1 if one had to be killed."""
    n = settings.gateway.processes
    if settings.gateway.port == 0:
        raise ValueError("LLAMAMESH_GATEWAY_PROCESSES > 1 needs a fixed LLAMAMESH_GATEWAY_PORT")
    Normalizer.parse(settings.gateway.normalize_rules)  # a bad rule fails here, not as children crash-looping
    # One scrape for all of them: the children write their metrics into one directory, served here.
    g = settings.gateway
    agg = metrics.Aggregate(g.metrics_port, g.host, "gateway", prometheus_multiproc_dir())
    env = settings.with_overrides(gateway={"processes": 1, "share_port": True, "metrics_port": 0}).to_env()
    env.update(agg.children_env())
    children = [
        Child(f"gateway-{i}", (sys.executable, "-m", "services"), {**env, "LLAMAMESH_LOG_PROCESS": f"gateway-{i}"})
        for i in range(n)
    ]
    sup = Supervisor(children, on_exit=lambda state: agg.process_dead(state.pid))
    try:
        sup.start()
        log.info("gateways_started", processes=n, port=g.port, pids=[s.pid for s in sup.states.values()])
        try:
            sup.run()
        finally:
            code = sup.stop(g.settle_s + g.grace_s + 10)
    finally:
        agg.close()
    return code


def raise_open_files_limit(most: int = 1 << 20) -> int:
    """Raise this process's open-files limit to its hard limit (at most ``most``), as ``vllm serve``
    does: each connection holds a descriptor, and containers often start at 1024 of a far higher
    hard limit. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # (a kernel cap below the hard limit)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main() -> None:
    try:
        settings = Settings.from_env().checked_for_process()
    except ValueError as exc:  # a bad setting: one line naming it, exit code 1
        sys.exit(f"error: {exc}")
    if settings.gateway.event_loop not in EVENT_LOOPS:  # (uvloop may be missing where the Literal allows it)
        sys.exit(
            f"error: LLAMAMESH_GATEWAY_EVENT_LOOP: expected one of {', '.join(EVENT_LOOPS)}, "
            f"got {settings.gateway.event_loop!r}"
        )
    logs.configure(settings.log, "gateway")
    tracing.configure("gateway")
    log.info("open_files_limit", limit=raise_open_files_limit())
    if settings.gateway.processes > 1:
        sys.exit(supervise(settings))
    try:
        run_main(serve(settings, share_port=settings.gateway.share_port), settings.gateway.event_loop)
    except StartFailed as exc:
        sys.exit(f"error: the gateway could not start: {exc}")


if __name__ == "__main__":
    main()
