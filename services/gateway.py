"""The gateway assembled in one process (``start_gateway``): a grpc.aio server with the generation,
admin and batch services, health and reflection, and what they share (the relay, the view of the
pools, admission, the gatekeeper); ``Gateway.stop`` drains and closes it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from llamamesh.loop import cancel_and_wait
from llamamesh.ports import check_free
from llamamesh.queue.gateway_stores import FileStore, Quotas
from llamamesh.queue.protocol import BatchStore, JobQueue
from llamamesh.settings import AuthSettings, BatchSettings, BreakerSettings, GatewaySettings, LimitsSettings
from llamamesh.tenants import TenantsFile
from llamamesh.v1 import admin_pb2, admin_pb2_grpc, batch_pb2, batch_pb2_grpc, generation_pb2, generation_pb2_grpc
from services import tls
from services.accept import Acceptors
from services.admin import AdminServicer
from services.admission import Admission
from services.auth import Gatekeeper
from services.backends import Backends, backend_service
from services.batch import BatchServicer
from services.batch_sweeper import BatchSweeper
from services.generation import GenerationServicer
from services.health import HealthReporter
from services.http.batches import BatchRoutes
from services.http.door import HttpDoor
from services.normalize import Normalizer
from services.relay import QueueRelay
from services.routing import RoutingPolicy, tokenizer_counter

log = structlog.get_logger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
BATCH_SERVICE = batch_pb2.DESCRIPTOR.services_by_name["BatchService"].full_name
# A gRPC connection's TLS and HTTP/2 handshake, at most (seconds; gRPC's own default is 120).
HANDSHAKE_S = 10.0
# A call's metadata (its headers), at most (gRPC's hard limit; an API key, a long token, trace headers fit).
MAX_METADATA_BYTES = 16 * 1024
# gRPC's "never" for a duration in milliseconds.
NEVER_MS = 2**31 - 1


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
    # The OpenAI-compatible HTTP door (settings.http_port), and where it listens (0: off).
    http: HttpDoor | None = None
    http_port: int = 0
    # The tenants file (LLAMAMESH_AUTH_FILE) and the task that looks for its changes.
    tenants: TenantsFile | None = None
    tenants_watch: asyncio.Task[None] | None = None

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, stop accepting, give open streams ``grace_s``, then close (the
        health-only port last: probes see NOT_SERVING through the drain)."""
        await self.health.shutdown()
        # Both doors drain at once, each within grace_s.
        await asyncio.gather(self.server.stop(grace_s), *([self.http.stop()] if self.http is not None else []))
        if self.acceptors is not None:
            await self.acceptors.stop()
        await self.relay.close()
        await self.backends.stop()
        if self.admission is not None:
            await self.admission.stop()
        if self.sweeper is not None:
            await self.sweeper.stop()
        await cancel_and_wait(self.tenants_watch)
        if self.health_server is not None:
            await self.health_server.stop(0)


def transport_options(settings: GatewaySettings, share_port: bool) -> list[tuple[str, int]]:
    """The gRPC ports' connection options: the port shared or not, keepalive pings both ways, connection age."""
    ms = lambda s: min(int(s * 1000), NEVER_MS)  # noqa: E731
    options = [
        ("grpc.so_reuseport", 1 if share_port else 0),
        ("grpc.keepalive_time_ms", ms(settings.keepalive_s) if settings.keepalive_s else NEVER_MS),
        ("grpc.keepalive_timeout_ms", ms(settings.keepalive_timeout_s)),
        # (gRPC core waits this long for a ping's answer, the keepalive's too: one minute unless set)
        ("grpc.http2.ping_timeout_ms", ms(settings.keepalive_timeout_s)),
        # Pings on connections without calls, the gateway's and a client's (gRPC's default refuses a client's).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(settings.min_client_ping_s)),
        ("grpc.http2.max_ping_strikes", 2 if settings.min_client_ping_s else 0),
        # Request headers up to this size pass, larger are refused: gRPC's default refuses at random
        # between a soft limit (8 KiB) and this one.
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
    ]
    if settings.max_connection_age_s:
        options += [
            ("grpc.max_connection_age_ms", ms(settings.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(settings.max_connection_age_grace_s)),
        ]
    return options


async def health_only_server(
    reporter: HealthReporter, settings: GatewaySettings, share_port: bool
) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of grpc.health.v1 alone (the same statuses as the main port): Kubernetes'
    native gRPC probes cannot speak TLS, so with TLS on the main port they probe this one."""
    host, port = settings.host, settings.health_port
    check_free(host, port, "LLAMAMESH_GATEWAY_HEALTH_PORT", reuse_port=share_port)
    server = grpc.aio.server(options=transport_options(settings, share_port))
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
    files: FileStore | None = None,
) -> Gateway:
    """Build and start the server on ``settings.host`` (port 0: a free one; ``share_port``: one of
    several gateway processes on it, SO_REUSEPORT). ``auth.file``: callers must authenticate;
    ``quotas``: tenants' budgets are enforced; ``batches``: the batch service runs (and with
    ``files``, the HTTP door's Files and Batches endpoints). A bad routing
    or normalisation rule raises ValueError before anything starts."""
    models = settings.model_table()
    policy = RoutingPolicy.parse(settings.routes, tokenizer_counter(settings.tokenizer) if settings.tokenizer else None)
    normalizer = Normalizer.parse(settings.normalize_rules, settings.affinity_prefix_chars)
    batch = batch or BatchSettings()
    limits = limits or LimitsSettings()
    auth_file = (auth or AuthSettings()).file
    tenants = TenantsFile(auth_file, limits) if auth_file else None
    server, gatekeeper = _grpc_server(settings, batch, tenants, limits, share_port)
    acceptors = Acceptors(server, [gatekeeper], settings.acceptors)  # before any service is added
    admission = Admission(quotas)
    services = [GENERATION_SERVICE, ADMIN_SERVICE, *([BATCH_SERVICE] if batches is not None else [])]
    reporter = HealthReporter.for_gateway(queue, services, settings)
    backends = _backends(
        queue, settings, breaker or BreakerSettings(), [*(m.pool for m in models), *policy.pools], reporter
    )
    relay = QueueRelay(queue, settings, backends, policy, reporter.queue_generation)
    # What both services share; each tenant's own prefix cache as set, or (auto) when callers authenticate.
    tenant_cache = settings.cache_scope == "tenant" or (settings.cache_scope == "auto" and tenants is not None)
    shared: dict[str, Any] = {"admission": admission, "normalizer": normalizer, "tenant_cache": tenant_cache}
    shared["adapters_of"] = backends.adapters
    generation = GenerationServicer(relay, settings, models, **shared)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(backends, queue, models), server)
    sweeper, routes = None, None
    if batches is not None:
        servicer = BatchServicer(batches, settings, batch, models, policy, **shared)
        sweeper, routes = _batch_service(server, servicer, batches, batch, quotas, files)
    http = HttpDoor(generation, gatekeeper, settings, models, backends.adapters, routes) if settings.http_port else None
    _add_health(server, reporter, services if settings.reflection else None)
    gateway = Gateway(server, reporter, backends, relay, 0, acceptors, sweeper, admission, http=http, tenants=tenants)
    await _start(gateway, settings, port, share_port)
    _log_started(gateway, settings, normalizer, tenants)
    return gateway


def _batch_service(
    server: grpc.aio.Server,
    servicer: BatchServicer,
    batches: BatchStore,
    batch: BatchSettings,
    quotas: Quotas | None,
    files: FileStore | None,
) -> tuple[BatchSweeper, BatchRoutes | None]:
    """The batch service on ``server``, its sweeper, and (with ``files``) its HTTP door's routes."""
    batch_pb2_grpc.add_BatchServiceServicer_to_server(servicer, server)
    sweeper = BatchSweeper(batches, batch.sweep_interval_s, quotas, batch.retention_s)
    routes = BatchRoutes(servicer, files, batch.max_bytes, batch.retention_s) if files is not None else None
    return sweeper, routes


def _log_started(
    gateway: Gateway, settings: GatewaySettings, normalizer: Normalizer, tenants: TenantsFile | None
) -> None:
    log.info(
        "gateway_started",
        host=settings.host,
        port=gateway.port,
        tls=bool(settings.tls_cert),
        mtls=bool(settings.tls_client_ca),
        health_port=gateway.health_port or None,
        http_port=gateway.http_port or None,
        acceptors=gateway.acceptors.n if gateway.acceptors else 0,
    )
    if normalizer:
        log.info("normalize_rules_loaded", rules=[r.name for r in normalizer.rules])
    if tenants is not None:
        log.info("gateway_auth", tenants=len(tenants.current().tenants), file=tenants.path)


def _grpc_server(
    settings: GatewaySettings,
    batch: BatchSettings,
    tenants: TenantsFile | None,
    limits: LimitsSettings,
    share_port: bool,
) -> tuple[grpc.aio.Server, Gatekeeper]:
    """The grpc.aio server, behind the gatekeeper (authentication, concurrency, request sizes)."""
    # The transport takes the largest request of any RPC; the gatekeeper bounds each RPC's own.
    batch_bytes = batch.max_bytes + 1024 * 1024  # a batch just past max_bytes: INVALID_ARGUMENT naming it
    gatekeeper = Gatekeeper(
        tenants,
        limits,
        settings.max_concurrent_rpcs,
        settings.max_request_bytes,
        {f"/{BATCH_SERVICE}/BatchGenerate": (batch_bytes, "LLAMAMESH_BATCH_MAX_BYTES")},
    )
    server = grpc.aio.server(
        interceptors=[gatekeeper],
        options=[
            *transport_options(settings, share_port),
            ("grpc.max_receive_message_length", max(batch_bytes, settings.max_request_bytes)),
            # A connection that has not finished its TLS and HTTP/2 handshake by then is closed.
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_S * 1000)),
        ],
    )
    return server, gatekeeper


def _backends(
    queue: JobQueue, settings: GatewaySettings, breaker: BreakerSettings, pools: list[str], reporter: HealthReporter
) -> Backends:
    """The view of ``pools`` (and their fallbacks), its health and the queue's told to ``reporter``."""
    backends = Backends(
        queue,
        pools,
        settings.fallback_table(),
        breaker,
        on_health=lambda pool, up: reporter.set_backend(backend_service(pool), up),
    )
    reporter.watch(backends.saw_queue)
    reporter.watch_writes(backends.saw_writes)
    return backends


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _describe_reflection_v1() -> None:
    """grpc.reflection.v1's file in the default descriptor pool, so that reflection describes the v1
    service it lists: v1alpha's messages under v1's package, which is what v1 is (grpcio-reflection
    ships only v1alpha's descriptors)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(REFLECTION_V1_FILE)
        return
    except KeyError:
        pass
    alpha = f".{reflection_pb2.DESCRIPTOR.package}."
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = REFLECTION_V1_FILE, REFLECTION_V1.rsplit(".", 1)[0]
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:  # (a message's: scalars have none)
                field.type_name = field.type_name.replace(alpha, f".{proto.package}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(alpha, f".{proto.package}.")
        method.output_type = method.output_type.replace(alpha, f".{proto.package}.")
    pool.Add(proto)


def _add_health(server: grpc.aio.Server, reporter: HealthReporter, reflected: list[str] | None) -> None:
    """grpc.health.v1 on the server, and reflection of ``reflected`` services (None: no reflection)."""
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    if reflected is not None:
        health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        _describe_reflection_v1()
        servicer = reflection.aio.ReflectionServicer((*reflected, health, REFLECTION_V1, reflection.SERVICE_NAME))
        # grpc.reflection.v1 (newer tools ask only it) and v1alpha (grpcurl's): one protocol under two
        # names, the same messages on the wire.
        for name in (REFLECTION_V1, reflection.SERVICE_NAME):
            handlers = {
                "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                    servicer.ServerReflectionInfo,
                    request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                    response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                )
            }
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
            server.add_registered_method_handlers(name, handlers)


async def _start(gateway: Gateway, settings: GatewaySettings, port: int | None, share_port: bool) -> None:
    """Listen (and on the health-only port), then start serving and every background task."""
    gateway.port = tls.bind(gateway.server, settings, port, share_port)
    if settings.health_port:
        gateway.health_server, gateway.health_port = await health_only_server(gateway.health, settings, share_port)
    if gateway.http is not None:
        gateway.http_port = await gateway.http.start(settings.http_port, tls.ssl_context(settings), share_port)
    await gateway.server.start()
    if gateway.acceptors is not None:
        gateway.acceptors.start()
    await gateway.health.start()
    await gateway.backends.start()
    if gateway.admission is not None:
        gateway.admission.start()
    if gateway.sweeper is not None:
        gateway.sweeper.start()
    if gateway.tenants is not None:
        gateway.tenants_watch = asyncio.create_task(gateway.tenants.watch(), name="tenants-file")
