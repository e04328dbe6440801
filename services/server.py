"""The gateway process: a grpc.aio server with GenerationService, health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llamamesh import logs, metrics, tracing
from llamamesh.loop import EVENT_LOOPS, run_main, serving_heap
from llamamesh.queue.batches import RedisBatches
from llamamesh.queue.protocol import BatchStore, JobQueue
from llamamesh.queue.quotas import Quotas, RedisQuotas
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import (
    AuthSettings,
    BatchSettings,
    BreakerSettings,
    GatewaySettings,
    LimitsSettings,
    Settings,
    prometheus_multiproc_dir,
)
from llamamesh.supervisor import Child, Supervisor
from llamamesh.tenants import TenantsFile
from llamamesh.v1 import admin_pb2, admin_pb2_grpc, batch_pb2, batch_pb2_grpc, generation_pb2, generation_pb2_grpc
from services import tls
from services.accept import Acceptors
from services.admin import AdminServicer
from services.admission import Admission
from services.auth import Gatekeeper
from services.backends import Backends, backend_service
from services.batch import BatchServicer, BatchSweeper
from services.generation import GenerationServicer
from services.health import HealthReporter
from services.normalize import Normalizer
from services.relay import QueueRelay
from services.routing import RoutingPolicy, tokenizer_counter

log = structlog.get_logger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
BATCH_SERVICE = batch_pb2.DESCRIPTOR.services_by_name["BatchService"].full_name


@dataclass
class Gateway:
    server: grpc.aio.Server
    health: HealthReporter
    backends: Backends
    relay: QueueRelay
    port: int
    acceptors: Acceptors | None = None
    sweeper: BatchSweeper | None = None
    admission: Admission | None = None
    # The plaintext health-only port (settings.health_port), and where it listens (0: none).
    health_server: grpc.aio.Server | None = None
    health_port: int = 0

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, stop accepting, give open streams ``grace_s``, then close (the
        health-only port last: probes see NOT_SERVING through the drain)."""
        await self.health.shutdown()
        await self.server.stop(grace_s)
        if self.acceptors is not None:
            await self.acceptors.stop()
        await self.relay.close()
        await self.backends.stop()
        if self.admission is not None:
            await self.admission.stop()
        if self.sweeper is not None:
            await self.sweeper.stop()
        if self.health_server is not None:
            await self.health_server.stop(0)


async def health_only_server(
    reporter: HealthReporter, host: str, port: int, share_port: bool
) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of grpc.health.v1 alone (the same statuses as the main port): Kubernetes'
    native gRPC probes cannot speak TLS, so with TLS on the main port they probe this one."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if share_port else 0)])
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port} (LLAMAMESH_GATEWAY_HEALTH_PORT)")
    await server.start()
    return server, bound


async def start_gateway(
    queue: JobQueue,
    settings: GatewaySettings,
    port: int | None = None,
    share_port: bool = False,
    breaker: BreakerSettings | None = None,
    batches: BatchStore | None = None,
    batch: BatchSettings | None = None,
    auth: AuthSettings | None = None,
    limits: LimitsSettings | None = None,
    quotas: Quotas | None = None,
) -> Gateway:
    """Build and start the server on ``settings.host``; port 0 picks a free port. ``share_port``: one
    of several gateway processes on the same port (SO_REUSEPORT); otherwise a taken port fails.
    ``auth.file``: callers must authenticate (services/auth.py); ``quotas``: tenants' budgets are
    enforced (none: unlimited, e.g. over the in-memory queue of unit tests)."""
    models = settings.model_table()
    policy = RoutingPolicy.parse(settings.routes, tokenizer_counter(settings.tokenizer) if settings.tokenizer else None)
    normalizer = Normalizer.parse(settings.normalize_rules, settings.affinity_prefix_chars)  # bad rule: ValueError
    batch = batch or BatchSettings()
    limits = limits or LimitsSettings()
    tenants = TenantsFile((auth or AuthSettings()).file, limits) if (auth or AuthSettings()).file else None
    # The transport takes the largest request of any RPC; the gatekeeper bounds each RPC's own.
    batch_bytes = batch.max_bytes + 1024 * 1024  # a batch just past max_bytes: INVALID_ARGUMENT naming it
    gatekeeper = Gatekeeper(
        tenants, limits, settings.max_concurrent_rpcs, settings.max_request_bytes,
        {f"/{BATCH_SERVICE}/BatchGenerate": (batch_bytes, "LLAMAMESH_BATCH_MAX_BYTES")},
    )  # fmt: skip
    server = grpc.aio.server(
        interceptors=[gatekeeper],
        options=[
            ("grpc.so_reuseport", 1 if share_port else 0),
            ("grpc.max_receive_message_length", max(batch_bytes, settings.max_request_bytes)),
        ],
    )
    acceptors = Acceptors(server, [gatekeeper], settings.acceptors)  # before any service is added
    admission = Admission(quotas)
    reporter = HealthReporter(
        queue,
        [GENERATION_SERVICE, ADMIN_SERVICE, *([BATCH_SERVICE] if batches else [])],
        interval_s=settings.health_interval_s,
        data_loss_hold_s=settings.data_loss_hold_s,
    )
    backends = Backends(
        queue,
        [*(m.pool for m in models), *policy.pools],
        settings.fallback_table(),
        breaker or BreakerSettings(),
        on_health=lambda pool, up: reporter.set_backend(backend_service(pool), up),
    )
    reporter.watch(backends.saw_queue)
    reporter.watch_writes(backends.saw_writes)
    relay = QueueRelay(queue, settings, backends, policy, reporter.queue_generation)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(relay, settings, models, admission, normalizer, adapters_of=backends.adapters), server
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(backends, queue, models), server)
    services = [GENERATION_SERVICE, ADMIN_SERVICE]
    sweeper = None
    if batches is not None:  # the batch store needs Redis (the in-memory queue of unit tests has none)
        batch_pb2_grpc.add_BatchServiceServicer_to_server(
            BatchServicer(batches, settings, batch, models, policy, admission=admission, normalizer=normalizer,
                          adapters_of=backends.adapters), server
        )
        services.append(BATCH_SERVICE)
        sweeper = BatchSweeper(batches, batch.sweep_interval_s, quotas, batch.retention_s)
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    if settings.reflection:
        reflection.enable_server_reflection(
            (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
    bound = tls.bind(server, settings, port)
    health_server, health_port = None, 0
    if settings.health_port:
        health_server, health_port = await health_only_server(reporter, settings.host, settings.health_port, share_port)
    await server.start()
    acceptors.start()
    await reporter.start()
    await backends.start()
    admission.start()
    if sweeper is not None:
        sweeper.start()
    mtls = bool(settings.tls_client_ca)
    log.info("gateway_started", host=settings.host, port=bound, tls=bool(settings.tls_cert), mtls=mtls,
             health_port=health_port or None, acceptors=acceptors.n)  # fmt: skip
    if normalizer:
        log.info("normalize_rules_loaded", rules=[r.name for r in normalizer.rules])
    if tenants is not None:
        log.info("gateway_auth", tenants=len(tenants.current().tenants), file=tenants.path)
    return Gateway(server=server, health=reporter, backends=backends, relay=relay, port=bound, sweeper=sweeper,
                   admission=admission, health_server=health_server, health_port=health_port,
                   acceptors=acceptors)  # fmt: skip


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
    metrics.serve(g.metrics_port, g.host, "gateway", prometheus_multiproc_dir())
    queue = RedisQueue.from_settings(settings.redis)
    batches = RedisBatches.from_settings(queue.client, queue.keys, settings.batch, replicas=queue.replicas)
    gateway = await start_gateway(
        queue, settings.gateway, share_port=share_port, breaker=settings.breaker, batches=batches, batch=settings.batch,
        auth=settings.auth, limits=settings.limits, quotas=RedisQuotas(queue.client, queue.keys),
    )  # fmt: skip
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


def main() -> None:
    settings = Settings.from_env()
    if settings.gateway.event_loop not in EVENT_LOOPS:
        sys.exit(f"LLAMAMESH_GATEWAY_EVENT_LOOP: expected one of {', '.join(EVENT_LOOPS)}, "
                 f"got {settings.gateway.event_loop!r}")  # fmt: skip
    logs.configure(settings.log, "gateway")
    tracing.configure("gateway")
    if settings.gateway.processes > 1:
        sys.exit(supervise(settings))
    run_main(serve(settings, share_port=settings.gateway.share_port), settings.gateway.event_loop)


if __name__ == "__main__":
    main()
