"""Every Prometheus metric of llamamesh, defined once, and the /metrics endpoint of each process.

Names are ``llamamesh_*`` in base units (``_seconds``, ``_total`` counters, ratios in [0, 1]); labels
are bounded (pool, method, code, reason, state, to, status, kind, rule: the configured normalisation
rules), never a request id or a tenant. A gateway process updates the gateway metrics, a worker the
worker ones, only through the names here. What each one means: docs/operations.md ("Observe").
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

from llamamesh import errors

log = structlog.get_logger(__name__)

# prometheus_client's own name for it: it reads the variable itself when it is imported, so it is the
# one variable no setting carries.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Latencies from a millisecond to ten minutes; token gaps finer.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# --- gateway
# The hot path stays cheap: per-request histograms are observed once per request (the inter-token
# latency once per streamed message that carries tokens), token counts are added at a request's end.

REQUESTS = Counter(
    "llamamesh_requests", "RPCs finished, by method, gRPC status code and pool ('' if none)", ["method", "code", "pool"]
)
REQUEST_DURATION = Histogram(
    "llamamesh_request_duration_seconds", "RPC duration, accept to end", ["method"], buckets=LATENCY_BUCKETS
)
INFLIGHT = Gauge("llamamesh_inflight_requests", "RPCs being served now", multiprocess_mode="livesum")
TTFT = Histogram(
    "llamamesh_time_to_first_token_seconds",
    "Gateway accept to the first token relayed",
    ["pool"],
    buckets=LATENCY_BUCKETS,
)
ITL = Histogram(
    "llamamesh_inter_token_latency_seconds",
    "Gap between successive relayed messages carrying tokens",
    ["pool"],
    buckets=TOKEN_GAP_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "llamamesh_queue_wait_seconds", "Gateway accept to a worker starting the request", ["pool"], buckets=LATENCY_BUCKETS
)
PROMPT_TOKENS = Counter("llamamesh_prompt_tokens", "Prompt tokens of finished requests", ["pool"])
GENERATION_TOKENS = Counter("llamamesh_generation_tokens", "Tokens relayed to callers", ["pool"])
QUEUE_DEPTH = Gauge(
    "llamamesh_queue_depth", "Jobs waiting unleased in the pool's work streams", ["pool"], multiprocess_mode="livemax"
)
QUEUE_PENDING = Gauge(
    "llamamesh_queue_pending", "Jobs leased by a worker and not yet acked", ["pool"], multiprocess_mode="livemax"
)
BREAKER_STATE = Gauge(
    "llamamesh_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["pool"], multiprocess_mode="livemax"
)
BREAKER_TRANSITIONS = Counter(
    "llamamesh_breaker_transitions", "Breaker transitions, by the state moved to", ["pool", "to"]
)
FAILOVERS = Counter("llamamesh_failovers", "Requests moved to another worker or pool after a loss", ["pool"])
DEAD_LETTERS = Counter("llamamesh_dead_letters", "Requests set aside in the pool's dead-letter stream", ["pool"])
ADMISSION_REJECTED = Counter("llamamesh_admission_rejected", "Requests refused before queueing, by reason", ["reason"])
WORKERS = Gauge(
    "llamamesh_workers",
    "Workers of the pool by heartbeat state, as the gateway sees them",
    ["pool", "state"],
    multiprocess_mode="livemax",
)
# At risk: open (not cancelling) batches with unfinished items and less than AT_RISK_FRACTION of their
# completion window left before their deadline (expires_at); set by the gateway's batch sweeper.
AT_RISK_FRACTION = 0.1
BATCHES_AT_RISK = Gauge(
    "llamamesh_batches_at_risk",
    "Open batches with unfinished items and under 10% of their completion window left",
    multiprocess_mode="livemax",
)
# Projected late: open batches whose unfinished items, at the rate their items have ended so far, end
# after their window (items not started by then end expired); the worst projection against its window.
BATCHES_PROJECTED_LATE = Gauge(
    "llamamesh_batches_projected_late",
    "Open batches that, at the rate their items have ended so far, finish after their completion window ends",
    multiprocess_mode="livemax",
)
BATCH_PROJECTED_FINISH = Gauge(
    "llamamesh_batch_projected_finish_ratio",
    "The latest open batch's projected finish, as a fraction of its completion window (above 1: late)",
    multiprocess_mode="livemax",
)
# Counted once per request (a Generate, a Tokenize, a batch item) and rule that changed its text,
# however many matches the rule rewrote in it (services/normalize.py).
PROMPT_REWRITES = Counter(
    "llamamesh_prompt_rewrites", "Requests whose prompt or messages a normalisation rule changed, by rule", ["rule"]
)
QUEUE_EVICTING = Gauge(
    "llamamesh_queue_evicting",
    "1 while Redis would evict keys at its maxmemory (maxmemory-policy other than noeviction): jobs, token streams "
    "and batch results could be lost",
    multiprocess_mode="livemax",
)
QUEUE_FULL = Gauge(
    "llamamesh_queue_full",
    "1 while Redis refuses writes at its maxmemory (full), as this gateway's health check finds",
    multiprocess_mode="livemax",
)
DISCONNECT_CANCEL = Histogram(
    "llamamesh_disconnect_cancel_seconds",
    "Caller gone to the cancel flag written for its worker",
    buckets=LATENCY_BUCKETS,
)

# --- worker

JOBS_STARTED = Counter(
    "llamamesh_jobs_started", "Requests (jobs) a worker started; batch items: llamamesh_batch_items", ["pool"]
)
JOBS_FINISHED = Counter(
    "llamamesh_jobs_finished",
    "Requests (jobs) a worker finished, by status (ok or the failure code); batch items: llamamesh_batch_items",
    ["pool", "status"],
)
WORKER_TOKENS = Counter(
    "llamamesh_worker_generated_tokens", "Tokens the worker's engine generated, for requests and batch items", ["pool"]
)
AFFINITY_LEASES = Counter(
    "llamamesh_affinity_leases",
    "Jobs a worker leased with prefix affinity on, by kind: own "
    "(from a partition it owns: its prefix cache may hold it) or stolen (another's, "
    "taken while it had nothing of its own)",
    ["pool", "kind"],
)
ENGINE_STEPS = Counter(
    "llamamesh_engine_steps",
    "Engine steps run (transformers: batched forward passes; vLLM: "
    "engine-core output batches this worker received; fake: tokens); rate() is the step "
    "throughput, generated tokens over steps the tokens per step",
    ["pool"],
)
WORKER_INFLIGHT = Gauge(
    "llamamesh_worker_inflight_jobs", "Jobs the worker runs now", ["pool"], multiprocess_mode="livesum"
)
ENGINE_RUNNING = Gauge(
    "llamamesh_engine_running_requests", "Requests running in the engine", ["pool"], multiprocess_mode="livesum"
)
ENGINE_WAITING = Gauge(
    "llamamesh_engine_waiting_requests", "Requests waiting inside the engine", ["pool"], multiprocess_mode="livesum"
)
BATCH_ITEMS = Counter(
    "llamamesh_batch_items", "Batch item results recorded by workers, by state (the item's status)", ["state"]
)
# The worker's adaptive batch admission (workers/allowance.py): its batch slots now, the interactive
# first-token signal it judged last, and the target it held that signal against.
BATCH_ALLOWANCE = Gauge(
    "llamamesh_worker_batch_allowance_slots",
    "Slots batch items may hold in this worker now (adaptive admission)",
    ["pool"],
    multiprocess_mode="livesum",
)
INTERACTIVE_TTFT_SIGNAL = Gauge(
    "llamamesh_worker_interactive_ttft_p90_seconds",
    "The last window's 90th percentile of interactive time to first token, as this worker's batch admission saw it",
    ["pool"],
    multiprocess_mode="livemax",
)
INTERACTIVE_TTFT_TARGET = Gauge(
    "llamamesh_worker_interactive_ttft_target_seconds",
    "The interactive time to first token this worker's batch admission holds its signal against",
    ["pool"],
    multiprocess_mode="livemax",
)
KV_CACHE_USAGE = Gauge(
    "llamamesh_engine_kv_cache_usage_ratio",
    "Fraction of the KV cache in use (largest worker)",
    ["pool"],
    multiprocess_mode="livemax",
)

BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}

# Admission refusals: the domain error's class -> the reason label.
_REASONS: tuple[tuple[type[errors.LlamameshError], str], ...] = (
    (errors.QueueFull, "queue_full"),
    (errors.QueueOutOfMemory, "queue_out_of_memory"),
    (errors.RateLimited, "rate_limited"),
    (errors.Unauthenticated, "unauthenticated"),
    (errors.PermissionDenied, "permission_denied"),
)


def rejected(exc: BaseException | None = None, reason: str = "") -> None:
    """Count a refusal of admission (``reason``, else the one of ``exc``'s class; other errors: nothing)."""
    if not reason:
        reason = next((r for cls, r in _REASONS if isinstance(exc, cls)), "")
    if reason:
        ADMISSION_REJECTED.labels(reason).inc()


def breaker_moved(pool: str, state: str) -> None:
    BREAKER_STATE.labels(pool).set(BREAKER_VALUES.get(state, 0))
    BREAKER_TRANSITIONS.labels(pool, state).inc()


def workers_seen(pool: str, states: Iterable[str], known: Iterable[str]) -> None:
    """The pool's workers counted by state; every state of ``known`` is set (0 when none is in it)."""
    counts = dict.fromkeys(known, 0)
    for s in states:
        counts[s] = counts.get(s, 0) + 1
    for s, n in counts.items():
        WORKERS.labels(pool, s).set(n)


@dataclass
class PoolRecorder:
    """A pool's gateway metrics with their label children bound once (the relay's hot path)."""

    pool: str
    ttft: Any = field(init=False)
    itl: Any = field(init=False)
    generated: Any = field(init=False)
    prompt: Any = field(init=False)

    def __post_init__(self) -> None:
        self.ttft = TTFT.labels(self.pool)
        self.itl = ITL.labels(self.pool)
        self.generated = GENERATION_TOKENS.labels(self.pool)
        self.prompt = PROMPT_TOKENS.labels(self.pool)


_recorders: dict[str, PoolRecorder] = {}


def pool_recorder(pool: str) -> PoolRecorder:
    r = _recorders.get(pool)
    if r is None:
        r = _recorders[pool] = PoolRecorder(pool)
    return r


# --- serving


class _Off:
    """Stands for every metric of a process whose metrics nobody reads: each call does nothing."""

    def labels(self, *_values: str) -> _Off:
        return self

    def inc(self, _amount: float = 1) -> None:
        pass

    def dec(self, _amount: float = 1) -> None:
        pass

    def set(self, _value: float) -> None:
        pass

    def observe(self, _value: float) -> None:
        pass


def disable() -> None:
    """Record nothing from now on in this process (its metrics are neither served nor aggregated):
    every metric above becomes a no-op. Callers reach them as ``metrics.NAME`` at each use."""
    g = globals()
    off = _Off()
    for name, value in list(g.items()):
        if isinstance(value, Counter | Gauge | Histogram):
            g[name] = off
    _recorders.clear()


def serve(port: int, host: str, role: str, directory: str = "") -> int:
    """Serve /metrics on ``host:port`` (``LLAMAMESH_GATEWAY_METRICS_PORT`` /
    ``LLAMAMESH_WORKER_METRICS_PORT``) in a daemon thread; returns the port. ``directory``: this
    process is one of a multiprocess set (settings.prometheus_multiproc_dir), the scrape aggregates
    every process of it. Port 0 outside a set: nothing is served and nothing recorded (``disable``),
    so metrics off cost nothing. Raises OSError when the port is taken."""
    if port <= 0:
        if not directory:
            disable()
        return 0
    registry: Any
    if directory:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
    else:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # a port taken, a host that is no address here: name the setting
        setting = f"LLAMAMESH_{role.upper()}_METRICS_PORT"
        raise OSError(exc.errno, f"{setting}: cannot serve /metrics on {host}:{port}: {exc.strerror or exc}") from exc
    bound = int(server.server_address[1])
    log.info("metrics_serving", role=role, url=f"http://{host}:{bound}/metrics", multiprocess=bool(directory))
    return bound


class Aggregate:
    """The metrics of a set of child processes of one role (the gateway's
    ``LLAMAMESH_GATEWAY_PROCESSES``, the node's gateway and workers), served by their supervisor in
    one scrape with prometheus_client's multiprocess mode: a fresh directory (or the one this process
    writes into already, when it is itself a child of such a set), removed at :meth:`close` if it
    made it. The children get the directory (:meth:`children_env`) and the metrics port 0; the
    supervisor serves a ``MultiProcessCollector`` over it, in which gauges add the live processes'
    values (``livesum``) or keep the largest (``livemax``)."""

    def __init__(self, port: int, host: str, role: str, inherited: str = "") -> None:
        self.port = port
        self._owned = not inherited and port > 0
        # Port 0 and no set above: no directory, so the children record nothing (metrics off).
        self.directory = inherited or (tempfile.mkdtemp(prefix=f"llamamesh-metrics-{role}-") if self._owned else "")
        self.bound = 0
        if self._owned:
            self.bound = serve(port, host, role, self.directory)

    def children_env(self) -> dict[str, str]:
        """What each child's environment gets: the directory to write into (none: metrics off)."""
        return {MULTIPROC_ENV: self.directory} if self.directory else {}

    def process_dead(self, pid: int | None) -> None:
        """A child exited: its live gauges leave the sums."""
        if pid is not None and self.directory:
            with contextlib.suppress(OSError):
                multiprocess.mark_process_dead(pid, self.directory)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
