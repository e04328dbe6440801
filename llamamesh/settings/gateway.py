"""The gateway's settings: its port, limits on requests, shutdown, failover, routing, TLS, and the
circuit breaker in front of each backend pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamamesh.settings.schema import FRACTION, PORT, Range, Section, setting
from llamamesh.settings.worker import DEFAULT_MODEL, DEFAULT_POOL
from llamamesh.types import ModelInfo


@dataclass(frozen=True)
class GatewaySettings(Section, section="gateway"):
    """The gateway: its ports and TLS, the models it routes, bounds on requests, failover and shutdown."""

    host: str = "127.0.0.1"
    """The address the gateway's ports listen on."""

    port: int = setting(50051, PORT)
    """The gRPC port. 0: a free port, chosen at start."""

    http_port: int = setting(0, PORT)
    """The OpenAI-compatible HTTP door (services/http/door.py: /v1/chat/completions, /v1/completions,
    /v1/models, and with the batch service /v1/files and /v1/batches) on this port (host: ``host``; TLS and
    authentication as the gRPC port). 0: off; the
    embedded node (``llamamesh serve``/``demo``) opens it on 8000 unless this is set."""

    max_tokens_cap: int = setting(4096, Range(1))
    """Upper bound on GenerateRequest.max_tokens."""

    default_max_tokens: int = setting(256, Range(1))
    """max_tokens when the request leaves it unset."""

    models: str = f"{DEFAULT_MODEL}={DEFAULT_POOL}"
    """The models this gateway routes, as name=pool,name=pool; the first is the default."""

    grace_s: float = setting(10.0, Range(0))
    """Seconds open streams get to finish on shutdown."""

    settle_s: float = setting(2.0, Range(0))
    """On SIGTERM: seconds the gateway keeps serving new requests while its health says NOT_SERVING, so load
    balancers, Kubernetes endpoints and round_robin clients watching health move away before it stops accepting
    (then open streams get grace_s). Shutdown takes settle_s + grace_s at most: a pod's
    terminationGracePeriodSeconds must exceed both. A second signal skips it."""

    health_port: int = setting(0, PORT)
    """A second, plaintext port (on ``host``) serving grpc.health.v1 alone, with the main port's statuses: for
    Kubernetes' native gRPC probes, which cannot speak TLS. 0: none."""

    processes: int = setting(1, Range(1))
    """Gateway processes sharing the port (SO_REUSEPORT: the kernel spreads client connections over them), as `vllm
    serve --api-server-count`. One Python process relays about 12 k streamed messages a second on 2 shared cores
    within the latency targets (docs/benchmarks.md); on a GPU node, where each stream also carries more work, use one
    per core. 1: this process."""

    acceptors: int = setting(8, Range(0))
    """Extra requests for new calls each gateway process keeps outstanding per method, beyond grpc.aio's one
    (services/accept.py): a burst of new calls is accepted together instead of one per turn of a busy event loop.
    0: grpc's own accept loop alone."""

    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """The gateway process's event loop: "uvloop" (where installed, else asyncio's) or "asyncio". uvloop's cheaper
    callbacks cut the relay's CPU per message (docs/benchmarks.md)."""

    share_port: bool = False
    """Bind the port with SO_REUSEPORT, sharing it with other gateway processes (set for each of the `processes`
    children; also for several gateways of one host started by other means)."""

    fallback: str = ""
    """pool=fallback,...: where a pool's requests go while its breaker is open or it has no live worker, e.g.
    "trtllm=vllm,vllm=trtllm". Empty: no fallback."""

    failover_attempts: int = setting(2, Range(0))
    """How many times a request moves on when its worker is lost or its engine dies: to another worker of its pool or
    to the fallback; after tokens were sent it resumes from them."""

    max_worker_deaths: int = setting(2, Range(0))
    """A request whose workers died this many times while running it (a crash, a lost heartbeat, a dead engine) is a
    poison request: it is not sent to another worker but ends INTERNAL and is recorded in its pool's dead-letter
    stream. 0: only failover_attempts bounds it."""

    routes: str = ""
    """Routing rules, "cond & cond -> pool; ...", first match wins, else the model's pool (syntax and the shipped
    example: services/routing.py). Empty: every request goes to its model's pool."""

    tokenizer: str = ""
    """A tokenizer.json the routing rules count prompt tokens with. Empty: estimated (UTF-8 bytes / 4)."""

    cache_scope: Literal["auto", "tenant", "global"] = "auto"
    """Whose cached prompt prefixes a request may reuse in the engine's prefix (KV) cache: tenant, each
    tenant its own (the gateway sets the engine's cache salt from the authenticated tenant, which a
    caller can neither set nor see, and prefix affinity keys each tenant's prefixes apart); global, all
    share (e.g. a public system prompt; another tenant can then tell a cached prefix by its time to
    first token); auto, tenant when a tenants file is set (LLAMAMESH_AUTH_FILE), else global."""

    tool_parser: Literal["llama3_json", "hermes"] = "llama3_json"
    """How a model's output is read as tool calls (services/tools.py): llama3_json, Llama 3.x's
    {"name": ..., "parameters": {...}} (after <|python_tag|>, a list, or ";"-separated); hermes,
    calls inside <tool_call>...</tool_call> tags as Hermes and Qwen models write them (bare JSON calls
    too). Output that does not read as calls is the answer's text."""

    normalize_rules: str = ""
    """Prompt normalisation: regex rewrites of prompts and chat messages before routing and queueing, a JSON list of
    {"name", "pattern", "replacement", optional "flags", "applies_to", "roles"}, inline (starting with "[") or the
    path of a JSON file read at start (format: services/normalize.py). A bad rule stops the start. Empty: requests
    are left as sent."""

    max_queue: int = setting(10000, Range(0))
    """Requests of one tenant that may wait unleased in a pool (its own work stream there: one tenant's burst cannot
    fill the pool for the others); past it Generate answers RESOURCE_EXHAUSTED with RetryInfo (retry_after_s) at
    once. 0: no bound."""

    retry_after_s: float = setting(1.0, Range(0))
    """Seconds a caller refused for a full queue is told to wait before retrying (RetryInfo)."""

    no_worker_wait_s: float = setting(10.0, Range(0))
    """Seconds a request waits for a pool with no live worker (and no usable fallback) before it ends UNAVAILABLE; a
    pool empty for longer refuses new requests at once. Covers a worker's restart; 0: wait for one as long as the
    caller's deadline allows."""

    start_wait_s: float = setting(600.0, Range(0))
    """Seconds a request waits for a pool whose workers are all still starting (converting, loading, compiling the
    model: their heartbeats say so) before it ends UNAVAILABLE; never longer than the caller's deadline. Long
    enough for a cold GPU start. 0: as long as the deadline allows."""

    health_interval_s: float = setting(2.0, Range(above=0))
    """Seconds between the gateway's checks of Redis (readiness, and whether it lost its data)."""

    data_loss_hold_s: float = setting(10.0, Range(0))
    """Seconds readiness stays NOT_SERVING after Redis came back without its data."""

    unreachable_hold_s: float = setting(10.0, Range(0))
    """Seconds readiness stays SERVING while Redis does not answer (requests meanwhile end UNAVAILABLE with
    RetryInfo), so that a Redis failover or blip shorter than this does not take every gateway out of its load
    balancer at once; then NOT_SERVING until Redis answers. 0: NOT_SERVING at the first failed check. A gateway
    that has not reached Redis since it started is NOT_SERVING at once."""

    reattach_grace_s: float = setting(30.0, Range(0))
    """Seconds a resumable request (GenerateRequest.resumable) keeps generating after its caller's connection
    dropped, waiting for an Attach; then it is cancelled."""

    lost_worker_wait_s: float = setting(60.0, Range(0))
    """Seconds an Attach whose request's worker was lost waits for the request to go on elsewhere before it ends
    UNAVAILABLE: moved by the gateway that accepted it (at once, while that gateway follows it), or carried on in
    place by the worker that reclaims its job (LLAMAMESH_WORKER_CLAIM_IDLE_S to 1.5 times that after the death:
    keep this above it; a drained worker's hand-back too). An attempt that ended with the loss (its engine dead)
    can only be moved, which its gateway does at once: for it the wait is 5 s at most. 0: end at once."""

    tls_cert: str = ""
    """TLS: the server's certificate chain (PEM). With ``tls_key`` set too: the port speaks TLS only; the files are
    read again on the next handshake after they change (rotation, no restart). Empty: plaintext (a warning when
    the host is not a loopback address)."""

    tls_key: str = ""
    """TLS: the key of ``tls_cert`` (PEM)."""

    tls_client_ca: str = ""
    """Mutual TLS: clients must present a certificate signed by this CA (PEM), or the handshake fails."""

    reflection: bool = True
    """Serve gRPC reflection (grpcurl without .proto files). With auth on it needs a valid identity."""

    max_request_bytes: int = setting(4 * 1024 * 1024, Range(1))
    """Largest GenerateRequest / TokenizeRequest (and any other RPC's request but BatchGenerate, whose bound is
    LLAMAMESH_BATCH_MAX_BYTES), in bytes; past it: INVALID_ARGUMENT, unparsed."""

    max_prompt_chars: int = setting(1_000_000, Range(1))
    """Longest prompt (or all chat messages together), in characters, checked before anything tokenises it."""

    keepalive_s: float = setting(30.0, Range(0))
    """Seconds a gRPC connection may stay silent before the gateway pings it (HTTP/2 PING); a client that does not
    answer within keepalive_timeout_s is dropped and its calls cancelled, so a client that vanished (a dead host, a
    NAT or load balancer that forgot the flow) stops its generations. 0: no pings."""

    keepalive_timeout_s: float = setting(20.0, Range(above=0))
    """Seconds the gateway waits for the answer to its keepalive ping before closing the connection."""

    min_client_ping_s: float = setting(5.0, Range(0))
    """Shortest interval between a client's keepalive pings that the gRPC ports accept, with or without calls open
    (Go and Java clients ping every 10 s at the most; gRPC's own default policy refuses pings closer than 5 minutes
    on a connection that receives nothing, which would close a queued or quiet stream); a client pinging more often
    is sent GOAWAY "too_many_pings" after its third such ping. 0: any interval."""

    max_connection_age_s: float = setting(0.0, Range(0))
    """Seconds after which the gateway asks a gRPC client to reconnect (GOAWAY; its open calls go on for
    max_connection_age_grace_s): spreads long-lived HTTP/2 connections over gateways added since (a Kubernetes
    Service balances connections, not calls) and makes round_robin clients resolve the name again. 0: never."""

    max_connection_age_grace_s: float = setting(600.0, Range(0))
    """Seconds the calls open on a connection past max_connection_age_s get to finish before it is closed."""

    max_concurrent_rpcs: int = setting(10_000, Range(1))
    """RPCs one gateway process serves at once (health checks aside); past it: RESOURCE_EXHAUSTED."""

    metrics_port: int = setting(0, PORT)
    """Prometheus /metrics on this port (host: ``host``); with ``processes`` > 1 the supervising process serves every
    gateway process's metrics in one scrape (llamamesh/metrics.py). 0: off (``llamamesh serve``: a free port)."""

    affinity_prefix_chars: int = setting(1024, Range(0))
    """Prefix affinity: a request without GenerateRequest.prefix_key gets a hash of its prompt's (or its rendered
    chat messages') first this-many characters as its key. 0: none (the request id's hash places it: no affinity)."""

    def fallback_table(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in (x.strip() for x in self.fallback.split(",") if x.strip()):
            pool, sep, other = (part.strip() for part in item.partition("="))
            if not sep or not pool or not other or pool == other:
                raise ValueError(f"LLAMAMESH_GATEWAY_FALLBACK: expected pool=other_pool, got {item!r}")
            out[pool] = other
        return out

    def model_table(self) -> tuple[ModelInfo, ...]:
        out: list[ModelInfo] = []
        for i, item in enumerate(x.strip() for x in self.models.split(",") if x.strip()):
            name, sep, pool = item.partition("=")
            if not sep or not name.strip() or not pool.strip() or "=" in pool:
                raise ValueError(f"LLAMAMESH_GATEWAY_MODELS: expected name=pool, got {item!r}")
            if any(m.id == name.strip() for m in out):
                raise ValueError(f"LLAMAMESH_GATEWAY_MODELS: model {name.strip()!r} is listed twice")
            out.append(ModelInfo(id=name.strip(), pool=pool.strip(), default=i == 0))
        if not out:
            raise ValueError("LLAMAMESH_GATEWAY_MODELS lists no model")
        return tuple(out)


@dataclass(frozen=True)
class BreakerSettings(Section, section="breaker"):
    """The gateway's circuit breaker per backend pool, and the probes that feed it."""

    probe_interval_s: float = setting(1.0, Range(above=0))
    """Seconds between inference probes of each pool (a one-token generation)."""

    probe_timeout_s: float = setting(5.0, Range(above=0))
    """Seconds a probe may take before it counts as failed."""

    probe_failures: int = setting(3, Range(1))
    """Consecutive failed probes that open the breaker."""

    error_rate: float = setting(0.5, FRACTION)
    """Or: this failure rate over the last ``window`` real requests (at least ``min_requests`` of them)."""

    window: int = setting(20, Range(1))
    """How many of a pool's latest real requests ``error_rate`` is measured over."""

    min_requests: int = setting(10, Range(0))
    """Real requests the window must hold before ``error_rate`` may open the breaker."""

    open_s: float = setting(5.0, Range(0))
    """Seconds an open breaker stays open before letting a few requests through (half-open)."""

    half_open_max: int = setting(2, Range(1))
    """Half-open: at most this many requests or probes at a time."""

    half_open_successes: int = setting(2, Range(1))
    """Half-open: this many successes close the breaker."""

    liveness_grace_s: float = setting(3.0, Range(0))
    """After Redis was unreachable: for this long, failures count against no pool, and a worker whose heartbeat
    expired during the outage is still taken as alive (it heartbeats again within its interval once Redis is
    back). At least the workers' heartbeat TTL."""
