"""The queue's one way to talk to Redis: how a client is made, and what a Redis error becomes.

- ``connect``: a client whose pooled connections are checked before use once idle for
  ``health_check_s`` (a PING, so a connection Redis dropped while restarting is replaced, not
  failed on), and whose commands are retried once on a fresh connection after a connection error,
  with a jittered backoff (so a fleet does not reconnect in lockstep). A retried write may have
  been applied the first time; every write of the queue is safe to repeat (see streams.py and
  batches.py: submissions and attempt records are idempotent scripts, events are dropped by index
  by their reader). A ``rediss://`` url speaks TLS, with the CA and client certificate of the settings.
- ``unreachable``: Redis errors become ``QueueUnavailable`` here; callers see nothing of redis-py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from llamamesh.errors import QueueUnavailable
from llamamesh.settings import RedisSettings

UNREACHABLE = "the queue is unreachable"


@contextlib.contextmanager
def unreachable(refused: str = "") -> Iterator[None]:
    """Raise any Redis error inside as ``QueueUnavailable("the queue is unreachable")``; with
    ``refused`` (what failed, e.g. "cannot read the work stream"), an error reply of the server is
    raised as that, with the reply. Server replies the caller expects (NOGROUP, BUSYGROUP) it
    catches inside, re-raising the others."""
    try:
        yield
    except ResponseError as exc:
        raise QueueUnavailable(f"{refused}: {exc}" if refused else UNREACHABLE) from exc
    except RedisError as exc:
        raise QueueUnavailable(UNREACHABLE) from exc


def tls_options(settings: RedisSettings) -> dict[str, Any]:
    """redis-py's TLS arguments for a ``rediss://`` url: the CA to verify the server with (else the
    system's) and this client's certificate and key (mutual TLS). Empty for any other url; a TLS
    file set for one raises ValueError (it would silently go unused)."""
    files = {"ssl_ca_certs": settings.tls_ca, "ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if not settings.url.startswith("rediss://"):
        if any(files.values()):
            raise ValueError("LLAMAMESH_REDIS_TLS_* are set but LLAMAMESH_REDIS_URL is not rediss://")
        return {}
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("LLAMAMESH_REDIS_TLS_CERT and LLAMAMESH_REDIS_TLS_KEY must be set together")
    return {k: v for k, v in files.items() if v}


def connect(settings: RedisSettings) -> aioredis.Redis:
    """A client for ``settings.url`` (``rediss://``: TLS, see ``tls_options``); connects lazily."""
    if not settings.url:
        raise ValueError("RedisSettings.url is empty: start the embedded server first")
    return aioredis.Redis.from_url(
        settings.url,
        **tls_options(settings),
        # Blocking reads hold a connection each; the socket timeout must outlast them.
        socket_timeout=settings.block_ms / 1000 + 10,
        socket_connect_timeout=5,
        health_check_interval=settings.health_check_s,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=settings.retries),
        retry_on_error=[RedisConnectionError],
    )
