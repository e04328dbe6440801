"""Who may call, and every tenant's default limits (the tenants file may set its own)."""

from __future__ import annotations

from dataclasses import dataclass

from llamamesh.settings.schema import Range, Section, setting


@dataclass(frozen=True)
class AuthSettings(Section, section="auth"):
    """Who may call the gateway."""

    file: str = ""
    """The tenants file (JSON: tenants, their limits, hashed API keys, certificate identities; see
    llamamesh/tenants.py). Set: every RPC but grpc.health.v1 needs a valid identity. Empty: no authentication, the
    tenant is the x-llamamesh-tenant header (else "default")."""


@dataclass(frozen=True)
class LimitsSettings(Section, section="limits"):
    """Every tenant's limits unless the tenants file sets its own (0: no limit). Enforced in Redis,
    so all gateways share one budget per tenant."""

    requests_per_s: float = setting(0.0, Range(0))
    """Requests (Generate, BatchGenerate) per second."""

    burst: int = setting(0, Range(0))
    """Requests allowed in a burst above ``requests_per_s``. 0: one second's worth."""

    tokens_per_min: int = setting(0, Range(0))
    """Tokens generated per minute. A request is admitted while the budget is above zero and holds its most
    (max_tokens x n) from then until it ends, when what it did not generate is given back (a resumable request whose
    caller left keeps all of it: it goes on generating for an Attach)."""

    max_streams: int = setting(0, Range(0))
    """Generate, Attach and StreamBatchResults streams open at once. A resumable request whose caller left runs on
    for the re-attach grace (LLAMAMESH_GATEWAY_REATTACH_GRACE_S) without holding one: requests_per_s bounds how
    many a tenant leaves."""

    max_batch_items: int = setting(0, Range(0))
    """Batch items not finished yet."""

    max_batch_bytes: int = setting(0, Range(0))
    """Bytes of batches kept (until their results expire); and, apart, bytes of files uploaded to the HTTP door
    (until deleted)."""

    max_priority: int = 10
    """The highest GenerateRequest.priority a tenant may ask for (above it: PERMISSION_DENIED)."""

    pools: str = ""
    """Pools a tenant may use ("a,b"); empty: all."""

    tier: str = ""
    """The tenant's tier, for routing rules (``tier == premium -> premium``); empty: none."""

    weight: float = setting(1.0, Range(above=0))
    """Its share of a pool's workers against other tenants with work waiting (fair share)."""
