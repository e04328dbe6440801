"""What every connection the queue opens to Redis shares: its TLS files, its pool's bounds, timeouts,
health check and retry, and its command packer (hiredis's, in C).
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError

from llamamesh.settings import RedisSettings
from llamamesh.settings.redis import TLS_URLS


def tls_options(settings: RedisSettings) -> dict[str, Any]:
    """redis-py's TLS arguments for a ``rediss://`` (or ``rediss+sentinel://``: to the data nodes)
    url: the CA to verify the server with (else the system's) and this client's certificate and key
    (mutual TLS). Empty for any other url; a TLS file set for one raises ValueError (it would
    silently go unused)."""
    settings.check_tls()
    if not settings.url.startswith(TLS_URLS):
        return {}
    files = {"ssl_ca_certs": settings.tls_ca, "ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    return {k: v for k, v in files.items() if v}


class _HiredisPacking:
    """A connection mixin: commands packed by hiredis's ``pack_command`` (C), not by redis-py's
    asyncio ``AbstractConnection.pack_command`` (Python; 8.1 has no hook for a packer there, its
    sync client has one). Packing in Python was a visible share of the worker's time, which sends
    an XADD per engine step; in C it is several times cheaper. The same bytes as redis-py's for
    every argument redis-py accepts (str as UTF-8, bytes, int, float as repr); what it refuses
    (None, bool, other types) is refused as redis-py does, with DataError. Connections here use
    redis-py's default encoding (UTF-8, strict), which is hiredis's."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]  # "CONFIG GET" as one argument: its words are arguments (as redis-py)
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a bytearray or memoryview (which redis-py takes, hiredis not), or bad input
            pass
        args = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in args)
        try:
            return [hiredis.pack_command(args)]
        except TypeError as exc:
            kinds = sorted({type(a).__name__ for a in args if not isinstance(a, (str, bytes, int, float))})
            raise DataError(
                f"Invalid input of type: {', '.join(kinds) or exc}. Convert to a bytes, string, int or float first."
            ) from exc


_PACKED: dict[type, type] = {}


def hiredis_packed(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """``cls`` with its commands packed by hiredis (``_HiredisPacking``): a subclass of the same
    name, made once per class (``cls`` itself if it already is one)."""
    if issubclass(cls, _HiredisPacking) or not issubclass(cls, AbstractConnection):
        return cls
    if cls not in _PACKED:
        _PACKED[cls] = type(cls.__name__, (_HiredisPacking, cls), {"__module__": cls.__module__})
    return _PACKED[cls]


def options(settings: RedisSettings) -> dict[str, Any]:
    """What every client's connections share: timeouts, the health check, the retry, and the
    bound on connections (a blocking pool: a command that finds every connection busy waits for
    one, as long as a command may take, instead of failing at once, as redis-py's default pool
    does past 100: a burst of new calls on one gateway process would fail UNAVAILABLE)."""
    if settings.max_connections < 8:
        raise ValueError(f"LLAMAMESH_REDIS_MAX_CONNECTIONS must be 8 or more, not {settings.max_connections}")
    # Blocking reads hold a connection each: the socket timeout must outlast them, and a command
    # waiting for a free connection waits as long as one command may take.
    longest_s = settings.block_ms / 1000 + 10
    return {
        "max_connections": settings.max_connections,
        "timeout": longest_s,
        "socket_timeout": longest_s,
        "socket_connect_timeout": 5,
        "health_check_interval": settings.health_check_s,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=settings.retries),
        "retry_on_error": [RedisConnectionError],
    }
