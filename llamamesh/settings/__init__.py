"""Frozen settings, built once per process from the environment and CLI flags; the only reader of the
process's environment. Every field maps one-to-one to a variable ``LLAMAMESH_<SECTION>_<FIELD>`` (for
example ``LLAMAMESH_WORKER_MAX_INFLIGHT``); each value is checked against its type and bounds, and
docs/configuration.md lists them all (rendered by ``llamamesh.settings.reference``).

``schema`` says what a setting is; one module per section owner (``redis``, ``gateway``,
``worker``, ``engines``, ``batch``, ``tenants``, ``client``, ``log``); ``environment`` holds the
whole ``Settings`` and its reading. Every name is importable from here.
"""

from llamamesh.settings.batch import BatchSettings
from llamamesh.settings.client import ClientSettings
from llamamesh.settings.engines import TrtllmSettings, VllmSettings
from llamamesh.settings.environment import (
    SECRETS,
    Settings,
    is_set,
    otel_service_named,
    otlp_endpoint,
    prometheus_multiproc_dir,
)
from llamamesh.settings.gateway import BreakerSettings, GatewaySettings
from llamamesh.settings.log import LogSettings
from llamamesh.settings.redis import (
    SENTINEL_FORM,
    SENTINEL_PORT,
    SENTINEL_SCHEMES,
    RedisSettings,
    SentinelUrl,
    parse_sentinel_url,
)
from llamamesh.settings.schema import Range, env_name
from llamamesh.settings.tenants import AuthSettings, LimitsSettings
from llamamesh.settings.worker import DEFAULT_MODEL, DEFAULT_POOL, FAKE_CLOCKS, WorkerSettings, adapter_table

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_POOL",
    "FAKE_CLOCKS",
    "SECRETS",
    "SENTINEL_FORM",
    "SENTINEL_PORT",
    "SENTINEL_SCHEMES",
    "AuthSettings",
    "BatchSettings",
    "BreakerSettings",
    "ClientSettings",
    "GatewaySettings",
    "LimitsSettings",
    "LogSettings",
    "Range",
    "RedisSettings",
    "SentinelUrl",
    "Settings",
    "TrtllmSettings",
    "VllmSettings",
    "WorkerSettings",
    "adapter_table",
    "env_name",
    "is_set",
    "otel_service_named",
    "otlp_endpoint",
    "parse_sentinel_url",
    "prometheus_multiproc_dir",
]
