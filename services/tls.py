"""Transport security of the gateway's port: TLS, mutual TLS, and certificate rotation without a
restart. ``bind`` is the gateway's one way to open its port; ``CertificateFiles`` follows the files
as they change; ``peer_identities`` names the client certificate a handshake verified. How to set it
up: docs/operations.md ("Security").
"""

from __future__ import annotations

import ipaddress
import ssl
import threading
from pathlib import Path
from typing import Any

import grpc
import structlog

from llamamesh.ports import check_free
from llamamesh.settings import GatewaySettings

log = structlog.get_logger(__name__)

# The identities of a verified client certificate in a call's auth context: its subject's common
# name, then its subjectAltNames (DNS, URI, email, IP).
IDENTITY_KEYS = ("x509_common_name", "x509_subject_alternative_name")

Stamp = tuple[tuple[int, int, int], ...]


class CertificateFiles:
    """The gateway's PEM files and the configuration last loaded from them, for gRPC (``fetch``) or
    as an ``ssl.SSLContext`` (``context``, the HTTP door's: ``door_context``). The files are looked at
    (mtime, size, inode) before every new connection's handshake; when they changed, they are read
    again and new connections get the new certificate, key and client CA. Connections already open
    keep theirs. A change that does not load (a key not matching its certificate: the pair is being
    written) keeps the previous files and is tried again at the next handshake, logged once as
    ``gateway_tls_reload_failed``."""

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self.paths = tuple(Path(p) for p in (cert, key, client_ca) if p)
        self._cert, self._key = Path(cert), Path(key)
        self._client_ca = Path(client_ca) if client_ca else None
        self._lock = threading.Lock()
        self._stamp: Stamp = ()
        self._failed: object = None
        self.context: ssl.SSLContext | None = None  # the files last loaded, as ssl's

    def _stamps(self) -> Stamp:
        out = []
        for p in self.paths:
            st = p.stat()
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def load(self) -> grpc.ServerCertificateConfiguration:
        """Read and check the files (the key matches the certificate; the CA is a certificate).
        Raises ValueError naming the file that does not load."""
        try:
            stamp = self._stamps()
            cert, key = self._cert.read_bytes(), self._key.read_bytes()
            ca = self._client_ca.read_bytes() if self._client_ca is not None else None
        except OSError as exc:
            raise ValueError(f"gateway TLS: cannot read {exc.filename}: {exc.strerror}") from exc
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # trusting no system CA for client certificates
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self._cert, self._key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"gateway TLS: {self._cert} and {self._key} are not a certificate and its key ({exc})"
            ) from exc
        if self._client_ca is not None:
            try:
                context.load_verify_locations(cafile=self._client_ca)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"gateway TLS: {self._client_ca} holds no CA certificate ({exc})") from exc
            context.verify_mode = ssl.CERT_REQUIRED
        if self._stamps() != stamp:  # what was checked may not be what was read
            raise ValueError("gateway TLS: the files changed while they were read")
        self._stamp = stamp
        self.context = context
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def door_context(self) -> ssl.SSLContext:
        """The context last loaded, which before each handshake (its SNI callback, called with or
        without a server name) looks at the files and hands the handshake the context last loaded:
        the HTTP door follows the files as the gRPC port does. Raises ValueError as ``load``."""
        if self.context is None:
            self.load()
        first = self.context
        assert first is not None

        def pick(conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
            self.fetch()
            if self.context is not None and self.context is not first:
                conn.context = self.context

        first.sni_callback = pick
        return first

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher, called before each new connection's handshake (in one of its threads): a
        new configuration when the files changed and load, else None (keep the current one)."""
        with self._lock:
            try:
                stamp = self._stamps()
            except OSError as exc:  # a file missing for a moment (being replaced)
                self._kept(f"cannot read {exc.filename}: {exc.strerror}", (exc.filename, exc.errno))
                return None
            if stamp == self._stamp:
                return None
            try:
                config = self.load()
            except ValueError as exc:
                self._kept(str(exc), stamp)
                return None
            self._failed = None
            log.info("gateway_tls_reloaded", files=[str(p) for p in self.paths])
            return config

    def _kept(self, error: str, failure: object) -> None:
        """The files as they are do not load: keep the current configuration, say so once per failure."""
        if self._failed != failure:
            log.warning("gateway_tls_reload_failed", error=error, files=[str(p) for p in self.paths])
            self._failed = failure


def server_credentials(settings: GatewaySettings) -> grpc.ServerCredentials:
    """TLS credentials from ``tls_cert`` / ``tls_key`` (and ``tls_client_ca``: mutual TLS) that
    follow the files as they change. Raises ValueError when they are not set together or do not load."""
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("LLAMAMESH_GATEWAY_TLS_CERT and LLAMAMESH_GATEWAY_TLS_KEY must be set together")
    if not settings.tls_cert:
        raise ValueError(
            "LLAMAMESH_GATEWAY_TLS_CLIENT_CA needs LLAMAMESH_GATEWAY_TLS_CERT and LLAMAMESH_GATEWAY_TLS_KEY"
            if settings.tls_client_ca
            else "gateway TLS: LLAMAMESH_GATEWAY_TLS_CERT and LLAMAMESH_GATEWAY_TLS_KEY are not set"
        )
    files = CertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    return grpc.dynamic_ssl_server_credentials(
        files.load(), files.fetch, require_client_authentication=bool(settings.tls_client_ca)
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(server: grpc.aio.Server, settings: GatewaySettings, port: int | None = None, share_port: bool = False) -> int:
    """Open ``settings.host`` on ``port`` (None: ``settings.port``; 0: a free one) with TLS when
    ``tls_cert`` and ``tls_key`` are set, else plaintext; returns the port bound. Raises ValueError
    for TLS settings that are incomplete or do not load, OSError (naming LLAMAMESH_GATEWAY_PORT) when
    the port cannot be bound; ``share_port``: the gateway's own processes share it.
    With ``tls_client_ca`` too, a client without a certificate signed by that CA is refused at the
    handshake (it sees UNAVAILABLE; no handler runs). Plaintext is logged as ``gateway_plaintext``
    (a warning) when the host is not a loopback address."""
    port = settings.port if port is None else port
    address = f"{settings.host}:{port}"
    tls = bool(settings.tls_cert or settings.tls_key or settings.tls_client_ca)
    check_free(settings.host, port, "LLAMAMESH_GATEWAY_PORT", reuse_port=share_port)
    bound = server.add_secure_port(address, server_credentials(settings)) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"LLAMAMESH_GATEWAY_PORT: cannot listen on {address}")
    if not tls and not is_loopback(settings.host):
        log.warning("gateway_plaintext", host=settings.host, port=bound)
    return int(bound)


def peer_identities(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    """The names (common name, then subjectAltNames) of the client certificate this call's
    connection presented and the handshake verified against ``tls_client_ca``; empty without
    mutual TLS."""
    auth = context.auth_context() or {}
    out: list[str] = []
    for key in IDENTITY_KEYS:
        for value in auth.get(key, ()):
            name = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            if name and name not in out:
                out.append(name)
    return tuple(out)


def peer_names(cert: dict[str, Any] | None) -> tuple[str, ...]:
    """The names of a verified client certificate as ``ssl`` gives it (``getpeercert()``): its
    common name, then its subjectAltNames, as ``peer_identities`` reads them from gRPC; empty
    without one."""
    if not cert:
        return ()
    out: list[str] = []
    for rdn in cert.get("subject", ()):
        out += [value for key, value in rdn if key == "commonName"]
    out += [value for _kind, value in cert.get("subjectAltName", ())]
    return tuple(dict.fromkeys(v for v in out if v))


def ssl_context(settings: GatewaySettings) -> ssl.SSLContext | None:
    """The HTTP door's TLS (None: plaintext): the gRPC port's certificate and key, and with
    ``tls_client_ca`` a client certificate signed by it required, as on gRPC; following the files
    as they change, as on gRPC (``CertificateFiles``)."""
    if not (settings.tls_cert or settings.tls_key or settings.tls_client_ca):
        return None
    server_credentials(settings)  # the same checks, the same one-line errors
    return CertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca).door_context()
