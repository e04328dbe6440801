"""What both clients hold: their channels, the service stubs over them, and their options."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from grpc_health.v1 import health_pb2_grpc

from llamamesh.client.connection import Connection
from llamamesh.settings import ClientSettings
from llamamesh.v1 import admin_pb2_grpc, batch_pb2_grpc, generation_pb2_grpc

ChannelT = TypeVar("ChannelT")


def options_of(settings: ClientSettings, tls: bool = False) -> dict[str, Any]:
    """The client keywords ``settings`` give (``tls``: TLS even without a CA file)."""
    return {
        "api_key": settings.api_key,
        "tls": tls,
        "tls_ca": settings.tls_ca,
        "tls_cert": settings.tls_cert,
        "tls_key": settings.tls_key,
        "tls_server_name": settings.tls_server_name,
        "retries": settings.retries,
        "load_balancing": settings.load_balancing,
        "connections": settings.connections,
        "resume_attempts": settings.resume_attempts,
    }


class Stubs(Generic[ChannelT]):
    """Channels (``connections`` of them: ``generate`` takes them in turn; everything else uses the
    first) and the stubs of every service over them. The generated stubs are untyped (grpc ships no
    type stubs): hence the ignores on creating them."""

    def _open(
        self,
        kind: str,
        address: str,
        channel: ChannelT | None,
        conn: Connection,
        connections: int,
        resume_attempts: int,
        make: Callable[[str, bool], ChannelT],
    ) -> None:
        """Raises ValueError naming ``kind`` for options that do not go together."""
        if channel is not None and (conn != Connection() or connections != 1):
            raise ValueError(f"{kind}: give either a channel or connection options, not both")
        if connections < 1:
            raise ValueError(f"{kind}: connections must be >= 1, got {connections}")
        if resume_attempts < 0:
            raise ValueError(f"{kind}: resume_attempts must be >= 0, got {resume_attempts}")
        self._resume_attempts = resume_attempts
        own = connections > 1  # each connection its own, not gRPC's shared one per address
        self._channels = [channel] if channel is not None else [make(address, own) for _ in range(connections)]
        self._channel = self._channels[0]
        self._streams = [generation_pb2_grpc.GenerationServiceStub(c) for c in self._channels]  # type: ignore[no-untyped-call]
        self._turn = itertools.count()
        self.stub = self._streams[0]
        self.batches = batch_pb2_grpc.BatchServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self.admin = admin_pb2_grpc.AdminServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _next_stream(self) -> generation_pb2_grpc.GenerationServiceStub:
        """The stub of the next connection in turn (for a ``generate`` stream)."""
        return self._streams[next(self._turn) % len(self._streams)]
