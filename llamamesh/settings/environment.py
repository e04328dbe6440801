"""The whole configuration (``Settings``, one field per section) and its one reader of the
environment: ``LLAMAMESH_*`` variables in (an unknown one refused, with the closest name), the
environment that rebuilds it in a child process out, and the other programs' own variables
(Prometheus', OpenTelemetry's) that llamamesh looks at.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_type_hints

from llamamesh.settings.batch import BatchSettings
from llamamesh.settings.client import ClientSettings
from llamamesh.settings.engines import TrtllmSettings, VllmSettings
from llamamesh.settings.gateway import BreakerSettings, GatewaySettings
from llamamesh.settings.log import LogSettings
from llamamesh.settings.redis import RedisSettings
from llamamesh.settings.schema import PREFIX, Section, Spec, env_name, section_from_env, specs
from llamamesh.settings.tenants import AuthSettings, LimitsSettings
from llamamesh.settings.worker import WorkerSettings

# Settings whose values are secrets (never printed).
SECRETS = frozenset({"LLAMAMESH_CLIENT_API_KEY"})


@dataclass(frozen=True)
class Settings:
    redis: RedisSettings = field(default_factory=RedisSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    trtllm: TrtllmSettings = field(default_factory=TrtllmSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    client: ClientSettings = field(default_factory=ClientSettings)
    log: LogSettings = field(default_factory=LogSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``LLAMAMESH_*`` variables. A bad value, or a ``LLAMAMESH_*`` variable
        that is no setting (a typo), raises ValueError in one line naming the variable."""
        env = os.environ if environ is None else environ
        refuse_unknown(env)
        values: dict[str, Any] = {name: section_from_env(section, env) for name, section in sections().items()}
        return cls(**values)

    def checked_for_process(self) -> Settings:
        """These settings, for one process of a node (``llamamesh gateway`` or ``worker``): ValueError
        naming the setting when it needs one that only a whole node (``llamamesh serve``) makes, or
        Redis's TLS files are not as its url needs them (``RedisSettings.check_tls``)."""
        if not self.redis.url:
            raise ValueError(
                "LLAMAMESH_REDIS_URL: required by one process of a node (only `llamamesh serve` starts an "
                "embedded Valkey): set it to the node's Redis, e.g. redis://127.0.0.1:6379"
            )
        self.redis.check_tls()
        return self

    def with_overrides(self, **sections: Mapping[str, Any]) -> Settings:
        """Settings with some fields replaced, e.g. ``worker={"engine": "fake"}``; None values are skipped.
        A value of the wrong type or out of bounds raises ValueError naming its variable."""
        changes = {}
        for name, values in sections.items():
            kept = {k: v for k, v in values.items() if v is not None}
            changes[name] = replace(getattr(self, name), **kept)
        return replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The environment that rebuilds these settings in a child process."""
        out: dict[str, str] = {}
        for name in sections():
            section = getattr(self, name)
            for spec in specs(type(section)):
                out[spec.env] = spec.text(getattr(section, spec.name))
        return out

    def redacted_env(self) -> dict[str, str]:
        """``to_env`` with secrets hidden (``llamamesh config``): API keys as ``***``, a password
        in a Redis url as ``***``."""
        out = self.to_env()
        for key, value in out.items():
            if value and key in SECRETS:
                out[key] = "***"
            elif value and key == "LLAMAMESH_REDIS_URL":
                out[key] = redacted_url(value)
        return out


def redacted_url(url: str) -> str:
    """A Redis url with its passwords as ``***``: the userinfo's (up to the host's ``@``, which is
    the last one: a password may hold an ``@``) and any query parameter named ``*password``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else netloc
    tail = re.sub(r"([?&][^=&#]*password=)[^&#]*", r"\1***", tail, flags=re.IGNORECASE)
    return f"{scheme}://{netloc}{tail}"


@functools.cache
def sections() -> dict[str, type[Section]]:
    """Each field of ``Settings`` and its section's class, in order."""
    hints = get_type_hints(Settings)
    return {f.name: hints[f.name] for f in fields(Settings)}


def all_specs() -> tuple[Spec, ...]:
    """Every setting, section by section."""
    return tuple(spec for section in sections().values() for spec in specs(section))


@functools.cache
def known_variables() -> frozenset[str]:
    return frozenset(spec.env for spec in all_specs())


def refuse_unknown(env: Mapping[str, str]) -> None:
    """ValueError naming the first ``LLAMAMESH_*`` variable of ``env`` that is no setting, and the
    setting it most likely meant."""
    known = known_variables()
    strays = sorted(key for key in env if key.startswith(PREFIX) and key not in known)
    if not strays:
        return
    # Matched without the prefix every name shares, which would make any name look close.
    tails = {name.removeprefix(PREFIX): name for name in known}
    close = difflib.get_close_matches(strays[0].removeprefix(PREFIX), tails, n=1)
    hint = f"; did you mean {tails[close[0]]}?" if close else " (docs/configuration.md lists the settings)"
    raise ValueError(f"{strays[0]} is not a setting{hint}")


def is_set(section: str, name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment sets that setting (``LLAMAMESH_<SECTION>_<NAME>``, not empty)."""
    env = os.environ if environ is None else environ
    return bool(env.get(env_name(section, name), "").strip())


def prometheus_multiproc_dir(environ: Mapping[str, str] | None = None) -> str:
    """``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's own variable, which it reads itself when
    imported): set by a supervisor that serves this process's metrics with its siblings'
    (llamamesh/metrics.py); empty otherwise."""
    env = os.environ if environ is None else environ
    return env.get("PROMETHEUS_MULTIPROC_DIR", "")


def otel_service_named(environ: Mapping[str, str] | None = None) -> bool:
    """Whether OpenTelemetry's own variables name the service (``OTEL_SERVICE_NAME``, or
    ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``): then the process keeps that name."""
    env = os.environ if environ is None else environ
    given = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return bool(env.get("OTEL_SERVICE_NAME", "").strip()) or any(
        kv.split("=", 1)[0].strip() == "service.name" for kv in given.split(",") if "=" in kv
    )


def otlp_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """Where spans go (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``,
    OpenTelemetry's own variables, which its exporter reads itself with the other ``OTEL_*``);
    empty: tracing is off (llamamesh/tracing.py)."""
    env = os.environ if environ is None else environ
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
