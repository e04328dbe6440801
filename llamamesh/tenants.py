"""The tenants file (``LLAMAMESH_AUTH_FILE``): who may call, as which tenant, within what limits.
Read by every gateway (``TenantsFile``: again whenever it changes, so a new or revoked key counts
within a second, without a restart), written by ``llamamesh auth create-key`` / ``revoke-key``. Its
format, with an example: docs/operations.md ("Security"); its limits: docs/api.md ("Tenants file
limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from llamamesh import errors
from llamamesh.settings import LimitsSettings
from llamamesh.types import TENANT_NAME

log = structlog.get_logger(__name__)

# An API key is ``lm_<key id>_<secret>``: the key id names it in logs and in the file.
KEY_PREFIX = "lm_"
# How often a gateway looks whether the file changed (seconds).
RELOAD_EVERY_S = 1.0

_LIMIT_FIELDS = {f.name: f.type for f in dataclasses.fields(LimitsSettings)}


@dataclass(frozen=True)
class Tenant:
    """One tenant of the file: its ``limits`` override ``LLAMAMESH_LIMITS_*`` (``LimitsSettings``)
    field by field; ``certificates`` are client-certificate identities (a subject CN or a SAN, as the
    gateway's mTLS handshake verified it) that authenticate as the tenant without a key; ``admin``
    (on the tenant or on one of its keys) may call AdminService."""

    name: str
    limits: LimitsSettings
    admin: bool = False
    certificates: tuple[str, ...] = ()


@dataclass(frozen=True)
class Identity:
    """Who is calling: a tenant, how it proved it (``via``: key, certificate, header or none),
    which key (its id, never the key), whether it may call AdminService, and its limits."""

    tenant: str
    via: str
    limits: LimitsSettings
    key_id: str = ""
    admin: bool = False


@dataclass(frozen=True)
class _Key:
    key_id: str
    tenant: str
    sha256: str
    admin: bool
    revoked: bool


def _limits(name: str, raw: Any, defaults: LimitsSettings) -> LimitsSettings:
    if not isinstance(raw, Mapping):
        raise ValueError(f"tenants file: tenants.{name}.limits must be an object")
    values: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in _LIMIT_FIELDS:
            known = ", ".join(_LIMIT_FIELDS)
            raise ValueError(f"tenants file: tenants.{name}.limits.{k} is not a limit (known: {known})")
        want = _LIMIT_FIELDS[k]
        ok = (
            isinstance(v, str)
            if want == "str"
            else isinstance(v, int | float) and not isinstance(v, bool)
            if want == "float"
            else isinstance(v, int) and not isinstance(v, bool)
        )
        if not ok:
            raise ValueError(f"tenants file: tenants.{name}.limits.{k} must be a {want}, got {v!r}")
        values[k] = float(v) if want == "float" else v
    for k, v in values.items():  # a value out of its range: the settings' own check, named as in the file
        try:
            replace(defaults, **{k: v})
        except ValueError as exc:
            why = str(exc).partition(": ")[2] or str(exc)
            raise ValueError(f"tenants file: tenants.{name}.limits.{k}={v!r}: {why}") from None
    return replace(defaults, **values)


class Tenants:
    """The parsed file. ``authenticate`` turns a bearer key or certificate identities into an
    Identity or raises Unauthenticated."""

    def __init__(self, tenants: Mapping[str, Tenant], keys: Mapping[str, _Key], defaults: LimitsSettings) -> None:
        self.tenants = dict(tenants)
        self._keys = dict(keys)
        self._defaults = defaults
        self._by_cert = {c: t.name for t in self.tenants.values() for c in t.certificates}

    @classmethod
    def parse(cls, doc: Any, defaults: LimitsSettings) -> Tenants:
        """From the JSON document; ValueError naming what is wrong."""
        if not isinstance(doc, Mapping):
            raise ValueError("tenants file: expected a JSON object with 'tenants' and 'keys'")
        for part in ("tenants", "keys"):
            if not isinstance(doc.get(part) or {}, Mapping):
                raise ValueError(f"tenants file: '{part}' must be an object")
        tenants: dict[str, Tenant] = {}
        for name, t in (doc.get("tenants") or {}).items():
            if not TENANT_NAME.match(name):
                raise ValueError(f"tenants file: tenant name {name!r}: 1-64 characters of A-Z a-z 0-9 . _ -")
            if not isinstance(t, Mapping):
                raise ValueError(f"tenants file: tenants.{name} must be an object")
            certs = t.get("certificates") or []
            if not isinstance(certs, list) or not all(isinstance(c, str) and c for c in certs):
                raise ValueError(f"tenants file: tenants.{name}.certificates must be a list of names")
            tenants[name] = Tenant(
                name, _limits(name, t.get("limits") or {}, defaults), bool(t.get("admin")), tuple(certs)
            )
        keys: dict[str, _Key] = {}
        for key_id, k in (doc.get("keys") or {}).items():
            if not isinstance(k, Mapping) or not isinstance(k.get("sha256"), str) or k.get("tenant") not in tenants:
                raise ValueError(f"tenants file: keys.{key_id} needs a sha256 and a tenant listed under 'tenants'")
            keys[key_id] = _Key(key_id, k["tenant"], k["sha256"], bool(k.get("admin")), bool(k.get("revoked")))
        return cls(tenants, keys, defaults)

    def authenticate(self, bearer: str, certificates: tuple[str, ...] = ()) -> Identity:
        """The identity of a caller presenting ``bearer`` (an API key; empty: none) and the verified
        client-certificate ``certificates`` (mTLS). A key, when given, must be valid (a bad key is
        refused even with a good certificate). Raises Unauthenticated. Only a key's SHA-256 is
        stored (keys are 256 random bits, so a fast hash is enough), compared in constant time."""
        if bearer:
            key_id = _key_id(bearer)
            k = self._keys.get(key_id) if key_id else None
            digest = hashlib.sha256(bearer.encode()).hexdigest()
            if k is None or not hmac.compare_digest(k.sha256, digest):
                raise errors.Unauthenticated("invalid API key")
            if k.revoked:
                raise errors.Unauthenticated(f"API key {key_id} was revoked")
            t = self.tenants[k.tenant]
            return Identity(t.name, "key", t.limits, key_id=key_id, admin=k.admin or t.admin)
        for name in certificates:
            if (tenant := self._by_cert.get(name)) is not None:
                t = self.tenants[tenant]
                return Identity(t.name, "certificate", t.limits, key_id=f"cert:{name}", admin=t.admin)
        if certificates:
            raise errors.Unauthenticated("the client certificate maps to no tenant")
        raise errors.Unauthenticated("authentication required: send 'authorization: Bearer <API key>'")


def _key_id(key: str) -> str:
    if not key.startswith(KEY_PREFIX):
        return ""
    key_id, sep, _secret = key[len(KEY_PREFIX) :].partition("_")
    return key_id if sep else ""


class TenantsFile:
    """The tenants file as a gateway sees it: parsed once, parsed again when it changed (looked at
    most every ``RELOAD_EVERY_S``). A file that turns unreadable or invalid keeps the last good
    version, logged once per distinct error (``tenants_file_refused``), as is each version taken
    (``tenants_file_reloaded``)."""

    def __init__(self, path: str, defaults: LimitsSettings) -> None:
        self.path = path
        self._defaults = defaults
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._next = 0.0
        self.last_error = ""
        self._tenants = self._load()  # a bad file at start: ValueError, the gateway does not start

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self) -> Tenants:
        try:
            stamp = self._stat()
            doc = json.loads(Path(self.path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"tenants file {self.path} (LLAMAMESH_AUTH_FILE): {exc}") from exc
        try:
            tenants = Tenants.parse(doc, self._defaults)
        except ValueError as exc:
            raise ValueError(f"{exc} (LLAMAMESH_AUTH_FILE {self.path})") from exc
        self._stamp = stamp
        return tenants

    def current(self) -> Tenants:
        now = time.monotonic()
        if now < self._next:
            return self._tenants
        with self._lock:
            self._next = now + RELOAD_EVERY_S
            try:
                if self._stat() != self._stamp:
                    self._tenants = self._load()
                    self.last_error = ""
                    log.info("tenants_file_reloaded", path=self.path, tenants=len(self._tenants.tenants))
            except (OSError, ValueError) as exc:
                if str(exc) != self.last_error:
                    log.warning("tenants_file_refused", path=self.path, error=str(exc), kept="the last valid version")
                self.last_error = str(exc)
        return self._tenants

    async def watch(self) -> None:
        """Look at the file every ``RELOAD_EVERY_S`` until cancelled, so that a change is taken (and
        logged) within a second even while no request comes to look."""
        while True:
            await asyncio.sleep(RELOAD_EVERY_S)
            await asyncio.to_thread(self.current)


# --- writing the file (the `llamamesh auth` commands)


@contextlib.contextmanager
def _editing(path: str) -> Iterator[dict[str, Any]]:
    """The document under an exclusive lock, written back atomically (mode 0600) on success."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc: dict[str, Any] = json.loads(target.read_text()) if target.exists() else {}
        Tenants.parse(doc, LimitsSettings())  # (one as the gateways take it: ValueError naming what is wrong)
        for part in ("tenants", "keys"):
            doc[part] = doc.get(part) or {}  # (absent or null: none yet)
        yield doc
        Tenants.parse(doc, LimitsSettings())  # never write a file the gateways would refuse
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tenants-")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)


def create_key(path: str, tenant: str, admin: bool = False) -> tuple[str, str]:
    """Add a key for ``tenant`` (added to the file if new) and return (key id, key). Only the
    key's hash is stored: the key itself cannot be read back."""
    if not TENANT_NAME.match(tenant):
        raise ValueError(f"tenant name {tenant!r}: 1-64 characters of A-Z a-z 0-9 . _ -")
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    with _editing(path) as doc:
        doc["tenants"].setdefault(tenant, {})
        doc["keys"][key_id] = {
            "tenant": tenant,
            "sha256": hashlib.sha256(key.encode()).hexdigest(),
            "admin": admin,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "revoked": False,
        }
    return key_id, key


def revoke_key(path: str, key_id: str) -> None:
    """Mark a key revoked (kept in the file, so its id stays known in logs). KeyError if unknown."""
    with _editing(path) as doc:
        if key_id not in doc["keys"]:
            raise KeyError(key_id)
        doc["keys"][key_id]["revoked"] = True


def list_keys(path: str) -> list[dict[str, Any]]:
    """Every key's id, tenant, admin flag, creation time and revocation (never a hash)."""
    doc = json.loads(Path(path).read_text())  # (a missing or broken file: OSError, ValueError)
    if not isinstance(doc, Mapping) or not isinstance(doc.get("keys") or {}, Mapping):
        raise ValueError(f"tenants file {path}: expected a JSON object with 'tenants' and 'keys'")
    return [
        {"key_id": kid, **{f: k.get(f) for f in ("tenant", "admin", "created", "revoked")}}
        for kid, k in sorted((doc.get("keys") or {}).items())
    ]
