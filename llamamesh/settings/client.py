"""How the CLI and the Python client reach a gateway."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamamesh.settings.schema import Range, Section, setting


@dataclass(frozen=True)
class ClientSettings(Section, section="client"):
    """How the CLI (and ``llamamesh.client.Client.from_settings``) reaches a gateway."""

    api_key: str = ""
    """The API key sent as ``authorization: Bearer <key>``."""

    tls_ca: str = ""
    """TLS: the CA that signed the gateway's certificate (set: the channel uses TLS)."""

    tls_cert: str = ""
    """Mutual TLS: this client's certificate (PEM)."""

    tls_key: str = ""
    """Mutual TLS: the key of ``tls_cert``."""

    tls_server_name: str = ""
    """Override of the name checked against the gateway's certificate (e.g. when dialling an IP)."""

    retries: int = setting(3, Range(0))
    """Times a call is retried on UNAVAILABLE before its first response (0: never), with backoff."""

    load_balancing: Literal["pick_first", "round_robin"] = "pick_first"
    """pick_first (one connection) or round_robin (every address the name resolves to, e.g. a Kubernetes headless
    Service as dns:///name:port, skipping gateways whose health is NOT_SERVING)."""

    connections: int = setting(1, Range(1))
    """Connections the async client spreads its Generate streams over (one gateway process serves each connection):
    about one per 32 concurrent streams for a client that relays many."""

    resume_attempts: int = setting(5, Range(0))
    """Times in a row a broken Generate stream is resumed through the channel (llamamesh/client/resume.py), and for
    at least 10 s: sent resumable, re-attached from what was delivered on UNAVAILABLE. 0: never (a broken stream is
    the caller's error, and a disconnect cancels the request)."""
