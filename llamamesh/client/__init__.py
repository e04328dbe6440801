"""The public Python client of a llamamesh gateway: ``Client`` (asyncio) and ``SyncClient`` (blocking).

Errors arrive as ``grpc.aio.AioRpcError`` / ``grpc.RpcError`` with the gateway's status code;
``field_violations(err)`` lists the fields an INVALID_ARGUMENT named. How a channel reaches the
gateway (API key, TLS, retries, load balancing): ``Connection``; a broken ``generate`` stream
resumed for its caller: ``llamamesh.client.resume``.
"""

from llamamesh.client.aio import Client
from llamamesh.client.connection import (
    DEFAULT_ADDRESS,
    LOAD_BALANCING,
    RETRIED_SERVICES,
    Connection,
    service_config,
    serving,
)
from llamamesh.client.requests import Messages, build_request, by_sample, response_format, tokenize_request
from llamamesh.client.resume import resumed, resumed_sync
from llamamesh.client.status import error_reason, field_violations
from llamamesh.client.sync import SyncClient

__all__ = [
    "DEFAULT_ADDRESS",
    "LOAD_BALANCING",
    "RETRIED_SERVICES",
    "Client",
    "Connection",
    "Messages",
    "SyncClient",
    "build_request",
    "by_sample",
    "error_reason",
    "field_violations",
    "response_format",
    "resumed",
    "resumed_sync",
    "service_config",
    "serving",
    "tokenize_request",
]
