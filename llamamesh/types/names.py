"""The names and ids callers choose: tenants, LoRA adapters, and how a tenant's ids are scoped."""

from __future__ import annotations

import hashlib
import re

# Tenant names: what the tenants file and the x-llamamesh-tenant header may hold (no "/": it
# separates a tenant from its ids, and no ":" or "~", which internal ids use).
TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_TENANT = "default"
# The gateways' health probes wait in a work stream of their own, which no caller's name can be: a
# worker's tenant headroom starts one at once however long any tenant's backlog (the default one's
# too); behind a backlog, a probe's timeout would open the pool's breaker while it serves.
PROBE_TENANT = "~probe"

# Adapter names (a worker's LLAMAMESH_WORKER_ADAPTERS, GenerateRequest.adapter): no ":" (it separates
# a model from its adapter) and nothing a path or a key would trip on.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def tenant_salt(tenant: str) -> str:
    """The prefix-cache salt of ``tenant``'s requests: its prompts are cached apart from any other
    tenant's. Derived from the name (callers never set or see it)."""
    return hashlib.sha256(f"llamamesh-cache-salt:{tenant}".encode()).hexdigest()[:32]


def scoped_id(tenant: str, public_id: str) -> str:
    """The id under which a tenant's request or batch lives in Redis: ``tenant/id``, so that two
    tenants may use one id independently; the default tenant's ids are bare (caller ids have no
    ``/``, so the namespaces never meet)."""
    return public_id if not tenant or tenant == DEFAULT_TENANT else f"{tenant}/{public_id}"


def public_id(scoped: str) -> str:
    """The id the caller chose, from ``scoped_id``'s result."""
    return scoped.rpartition("/")[2]
