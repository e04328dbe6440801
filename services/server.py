"""The gateway process: a grpc.aio server with GenerationService, health and reflection."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llamamesh import logs
from llamamesh.queue.protocol import JobQueue
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import GatewaySettings, Settings
from llamamesh.v1 import generation_pb2, generation_pb2_grpc
from services.generation import GenerationServicer
from services.health import HealthReporter

log = structlog.get_logger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


@dataclass
class Gateway:
    server: grpc.aio.Server
    health: HealthReporter
    port: int

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, stop accepting, give open streams ``grace_s``, then close."""
        await self.health.shutdown()
        await self.server.stop(grace_s)


async def start_gateway(queue: JobQueue, settings: GatewaySettings, port: int | None = None) -> Gateway:
    """Build and start the server on ``settings.host``; port 0 picks a free port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(
        GenerationServicer(queue, settings, settings.model_table()), server
    )
    reporter = HealthReporter(queue, [GENERATION_SERVICE])
    health_pb2_grpc.add_HealthServicer_to_server(reporter.servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = server.add_insecure_port(f"{settings.host}:{settings.port if port is None else port}")
    if bound == 0:
        raise OSError(f"cannot listen on {settings.host}:{settings.port}")
    await server.start()
    await reporter.start()
    log.info("gateway_started", host=settings.host, port=bound)
    return Gateway(server=server, health=reporter, port=bound)


async def serve(settings: Settings) -> None:
    """Run the gateway until SIGTERM/SIGINT, then drain."""


    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    queue = RedisQueue.from_settings(settings.redis)
    gateway = await start_gateway(queue, settings.gateway)
    try:
        await stop.wait()
    finally:
        log.info("gateway_stopping", grace_s=settings.gateway.grace_s)
        await gateway.stop(settings.gateway.grace_s)
        await queue.close()
        log.info("gateway_stopped")


def main() -> None:
    settings = Settings.from_env()
    logs.configure(settings.log, "gateway")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
