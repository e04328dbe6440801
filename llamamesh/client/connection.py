"""How a channel reaches the gateway: credentials, API key, retries and load balancing; and whether a
gateway answers at all (``serving``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llamamesh.client.interceptors import SyncMetadata, aio_interceptors

DEFAULT_ADDRESS = "127.0.0.1:50051"
LOAD_BALANCING = ("pick_first", "round_robin")
MAX_RECONNECT_BACKOFF_MS = 1000
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
RETRIED_SERVICES = ("llamamesh.v1.GenerationService", "llamamesh.v1.BatchService", "llamamesh.v1.AdminService")


@dataclass(frozen=True)
class Connection:
    """How a channel reaches the gateway: the keywords of ``Client``, ``SyncClient`` and ``serving``.

    ``api_key`` is sent as ``authorization: Bearer <key>`` on every call (plaintext channels too).
    The channel uses TLS when ``tls_ca`` is set (the CA the gateway's certificate is checked
    against), or ``tls=True`` (the system's CAs); ``tls_cert`` / ``tls_key`` add this client's
    certificate (mutual TLS); ``tls_server_name`` overrides the name the gateway's certificate must
    carry (when dialling an address it is not issued for). A file that cannot be read raises
    ValueError. A gateway refusing the handshake (an untrusted certificate either way, a missing
    client certificate) fails calls with UNAVAILABLE.

    Every call is retried on UNAVAILABLE before its first response message (``retries`` times, with
    gRPC's exponential backoff from 0.2 s: a gateway stopping or restarting, a refused connection).
    ``load_balancing="round_robin"`` spreads calls over every address the target resolves to
    (``dns:///gateway-headless.ns:50051`` for a Kubernetes headless Service, or
    ``ipv4:10.0.0.1:50051,10.0.0.2:50051``), watching each gateway's health so one that turns
    NOT_SERVING (draining) gets no new calls; the default, ``pick_first``, keeps one connection.
    """

    api_key: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    retries: int = 3
    load_balancing: str = "pick_first"

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_key)

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("the client's TLS certificate and key must be given together")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "CA"),
            private_key=_read(self.tls_key, "key"),
            certificate_chain=_read(self.tls_cert, "certificate"),
        )

    def options(self, own_connection: bool = False) -> list[tuple[str, Any]]:
        """The channel's options. ``own_connection``: its connections are its own, not shared with
        other channels to the same address (gRPC shares them by default)."""
        opts: list[tuple[str, Any]] = [
            ("grpc.service_config", service_config(self.retries, self.load_balancing)),
            # A gateway that went away is tried again at least every second (gRPC's default backoff
            # grows to 2 minutes), so a stream resumes as soon as it is back.
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
            # A batch result with logprobs can pass gRPC's default 4 MiB: take what a gateway may send.
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ]
        if self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if own_connection:
            opts.append(("grpc.use_local_subchannel_pool", 1))
        return opts

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def aio_channel(self, address: str, own_connection: bool = False) -> grpc.aio.Channel:
        """An asyncio channel to ``address`` (``own_connection``: as in ``options``)."""
        interceptors = aio_interceptors(self.metadata())
        opts = self.options(own_connection)
        if self.secure:
            return grpc.aio.secure_channel(address, self.credentials(), opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, opts, interceptors=interceptors)

    def channel(self, address: str, own_connection: bool = False) -> grpc.Channel:
        """A blocking channel to ``address`` (``own_connection``: as in ``options``)."""
        opts = self.options(own_connection)
        if self.secure:
            ch = grpc.secure_channel(address, self.credentials(), opts)
        else:
            ch = grpc.insecure_channel(address, opts)
        extra = self.metadata()
        return grpc.intercept_channel(ch, SyncMetadata(extra)) if extra else ch


def service_config(retries: int, load_balancing: str) -> str:
    """The channel's gRPC service config: ``load_balancing`` (round_robin also watches each
    backend's overall health), and a retry policy on UNAVAILABLE for llamamesh's services."""
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing: {load_balancing!r} is not one of {', '.join(LOAD_BALANCING)}")
    if retries < 0:
        raise ValueError(f"retries: {retries} < 0")
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
    if load_balancing == "round_robin":
        config["healthCheckConfig"] = {"serviceName": ""}
    if retries:
        config["methodConfig"] = [
            {
                "name": [{"service": s} for s in RETRIED_SERVICES],
                "retryPolicy": {
                    "maxAttempts": min(retries + 1, 5),
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return json.dumps(config)


def _read(path: str, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the client's TLS {what} {path}: {exc.strerror}") from exc


def serving(
    address: str,
    service: str = "",
    timeout_s: float = 1.0,
    *,
    api_key: str = "",
    tls: bool = False,
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    tls_server_name: str = "",
) -> bool:
    """Whether the gateway at ``address`` answers SERVING for ``service`` ("" the server; a
    blocking check for scripts and tests); False when it does not answer (a refused handshake
    included)."""
    conn = Connection(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name)
    with conn.channel(address) as ch:
        try:
            check = health_pb2.HealthCheckRequest(service=service)
            got = health_pb2_grpc.HealthStub(ch).Check(check, timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(got.status == health_pb2.HealthCheckResponse.SERVING)
