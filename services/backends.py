"""What the gateway knows about each backend pool: live workers (from their heartbeats), a circuit
breaker fed by inference probes and real requests, the pool's health, and where a request goes.

One ``Backends`` per gateway process owns one probe task per pool. Every ``probe_interval_s`` it
reads the pool's heartbeats; with no live (ready) worker the probe fails at once (no job is queued
for nobody), otherwise it sends a one-token greedy generation through the queue, like any request,
and waits ``probe_timeout_s`` for its end. The result feeds the pool's breaker; the breaker's state
and the live-worker count make the pool's health (``llamamesh.backend.<pool>``).

A pool whose workers are all still starting (heartbeat state ``starting``: converting, loading,
compiling) is coming up, not failing: its probes record nothing against the breaker, its health
is NOT_SERVING, and requests wait for it (``GatewaySettings.start_wait_s``). Workers that report
``failed`` count as absent, and their reasons go into the errors callers get.

Redis being unreachable is nobody's failure: probes and requests that fail while it is out (or
within ``liveness_grace_s`` of its return) record nothing against any breaker, the workers known
before the outage are kept meanwhile, and after it a worker whose heartbeat expired during it gets
``liveness_grace_s`` to heartbeat again before it counts as lost. A Redis that answers but refuses
writes (full at its maxmemory: no heartbeat can be written) is treated the same way.

Routing: a request goes to its model's pool unless that pool is unusable (breaker open, or no live
worker), then to the pool's configured fallback (``LLAMAMESH_GATEWAY_FALLBACK``, e.g.
``trtllm=vllm,vllm=trtllm``) if that one is usable, before any token is sent. Outcomes of real
requests are recorded: failures of the backend count (lost worker, engine failure, internal
error, timeout); client errors (bad input, unknown model, cancellation) never do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from llamamesh import errors, metrics
from llamamesh.queue.protocol import ProbeQueue, QueueDepth
from llamamesh.settings import BreakerSettings
from llamamesh.types import GenerationRequest, SamplingParams, WorkerState, WorkerStatus
from services.breaker import Breaker, State

log = structlog.get_logger(__name__)

PROBE_PROMPT = "ping"


def backend_service(pool: str) -> str:
    """The grpc.health.v1 service name of a pool."""
    return f"llamamesh.backend.{pool}"


def counts_against_backend(exc: BaseException | None) -> bool | None:
    """True: a failure of the backend; False: a success; None: neither (the caller's doing)."""
    if exc is None:
        return False
    if isinstance(exc, errors.ClientError | errors.CapacityError | errors.DeadlineUnreachable | asyncio.CancelledError):
        return None
    if isinstance(exc, errors.QueueUnavailable):  # Redis, not the backend
        return None
    return True


class TokenRate:
    """Tokens per second over the last ``window_s`` whole seconds: one counter per second in a ring,
    so that counting an event is an integer add (and a clock read)."""

    def __init__(self, clock: Callable[[], float], window_s: int = 5) -> None:
        self._clock = clock
        self._window = window_s
        self._second = [-1] * (window_s + 1)  # the second each slot counts (the current one too)
        self._tokens = [0] * (window_s + 1)

    def add(self, tokens: int) -> None:
        now = int(self._clock())
        i = now % len(self._second)
        if self._second[i] != now:
            self._second[i], self._tokens[i] = now, 0
        self._tokens[i] += tokens

    def per_s(self) -> float:
        """The mean over the last ``window_s`` whole seconds (the current one is not over yet)."""
        now = int(self._clock())
        n = sum(t for s, t in zip(self._second, self._tokens, strict=True) if now - self._window <= s < now)
        return n / self._window


@dataclass
class Pool:
    name: str
    breaker: Breaker
    workers: tuple[WorkerStatus, ...] = ()
    probes: int = 0
    last_probe_error: str = ""
    # Monotonic time since when the pool has had no worker ready or starting (set at start and on
    # every loss), and since when it has had starting workers and none ready.
    empty_since: float = 0.0
    starting_since: float = 0.0
    # The last read of its heartbeats failed (Redis out).
    unreachable: bool = False
    # Monotonic time until which workers known before an outage are kept though their heartbeats
    # are missing (they expired while Redis was out; each gets a round to come back).
    kept_until: float = 0.0
    # Its breaker opened only because it had no live worker (no probe of a worker failed): workers
    # that arrive close it outright, so a burst after a (re)start is served, not refused half-open.
    opened_empty: bool = False
    ever_live: bool = False
    # Recent queue wait (accepted -> a worker started it), an exponential average, and its samples.
    queue_wait_s: float = 0.0
    waits: int = 0
    # Tokens relayed to callers from this pool (services/relay.py), per second of late.
    tokens: TokenRate = field(default_factory=lambda: TokenRate(time.monotonic))

    @property
    def live(self) -> bool:
        """A worker is ready to serve."""
        return any(w.ready for w in self.workers)

    @property
    def starting(self) -> bool:
        """No worker is ready, and one is starting: the pool is coming up."""
        return not self.live and any(w.starting for w in self.workers)

    @property
    def present(self) -> bool:
        return self.live or self.starting

    def what_is_wrong(self) -> str:
        """What its workers say, for an error message: the starting ones' progress, the failed ones' reasons."""
        parts = [f"worker {w.worker} is {w.state}" + (f": {w.detail}" if w.detail else "")
                 for w in self.workers if not w.ready][:3]  # fmt: skip
        return "; ".join(parts)

    def usable(self) -> bool:
        return self.live and self.breaker.available()

    def serving(self) -> bool:
        return self.live and self.breaker.state is not State.OPEN


class Backends:
    def __init__(
        self,
        queue: ProbeQueue,
        pools: Sequence[str],
        fallback: Mapping[str, str],
        settings: BreakerSettings,
        on_health: Callable[[str, bool], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._queue = queue
        self._s = settings
        self.fallback = dict(fallback)
        names = list(dict.fromkeys([*pools, *self.fallback, *self.fallback.values()]))
        self._clock = clock
        self.pools = {p: Pool(p, Breaker(p, settings, clock=clock), empty_since=clock(), tokens=TokenRate(clock))
                      for p in names}  # fmt: skip
        for p in names:
            metrics.BREAKER_STATE.labels(p).set(0)
        self._on_health = on_health
        self._serving: dict[str, bool] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        # When the queue was last seen unreachable (monotonic), by anyone: None while it answers
        # since start. ``queue_down``: it is out now.
        self._down_at: float | None = None
        self.queue_down = False
        self.writes_refused = False  # (the health check's write probe: Redis full)

    # --- lifecycle

    async def start(self) -> None:
        """Read every pool once (so the first requests route on facts), then probe in the background."""
        await asyncio.gather(*(self.refresh(p) for p in self.pools.values()))
        self._tasks = [asyncio.create_task(self._probe_loop(p), name=f"probe-{p.name}") for p in self.pools.values()]

    async def stop(self) -> None:
        # The flag as well as the cancel: on Python < 3.12 asyncio.wait_for can swallow a cancel
        # that lands as the awaited probe finishes (gh-86296), and the loop would probe on forever.
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @property
    def check_interval_s(self) -> float:
        """How often a waiting request re-checks its worker's liveness (the heartbeats' refresh)."""
        return self._s.probe_interval_s

    # --- routing

    def route(self, pool: str) -> str:
        """The pool a new request of ``pool``'s model goes to, its breaker slot taken.

        The pool itself if it is usable, else its fallback if that is; else the pool anyway while
        its breaker lets requests through (no live worker yet: the job waits in the stream for
        one, as during a rolling restart). Raises NoWorkers when the pool's breaker is open and
        the fallback cannot take it either."""
        fallback = self.fallback.get(pool)
        for candidate in (pool, fallback):
            if candidate is None:
                continue
            p = self.pools[candidate]
            if p.live and p.breaker.allow():
                if candidate != pool:
                    log.info("request_fallback", pool=pool, to=candidate, state=self.pools[pool].breaker.state.value,
                             live_workers=len(self.pools[pool].workers))  # fmt: skip
                return candidate
        p = self.pools[pool]
        if p.breaker.allow():
            return pool
        why = "is failing (circuit open)" if p.live else "has no live worker (circuit open)"
        raise errors.NoWorkers(f"the backend pool {pool!r} {why}" + (
            f" and its fallback {fallback!r} cannot take requests" if fallback else ""))  # fmt: skip

    def observe_queue_wait(self, pool: str, seconds: float) -> None:
        p = self.pools.get(pool)
        if p is not None:
            p.queue_wait_s = seconds if not p.waits else 0.8 * p.queue_wait_s + 0.2 * seconds
            p.waits += 1

    def count_tokens(self, pool: str, n: int) -> None:
        """``n`` tokens of ``pool`` reached a caller (for ``tokens_per_s``)."""
        p = self.pools.get(pool)
        if p is not None:
            p.tokens.add(n)

    async def queue_depth(self, pool: str) -> QueueDepth | None:
        """The pool's jobs waiting and leased now; None while the queue is unreachable."""
        try:
            return await self._queue.queue_depth(pool)
        except errors.QueueUnavailable:
            self.saw_queue(False)
            return None

    def expected_queue_wait(self, pool: str) -> float:
        """The pool's recent queue wait in seconds (0 until it has a few samples)."""
        p = self.pools[pool]
        return p.queue_wait_s if p.waits >= 5 else 0.0

    def adapters(self, pool: str) -> frozenset[str] | None:
        """The LoRA adapters the pool's ready workers serve (any of them); None while none is ready (or
        the pool is unknown here): nobody can say yet."""
        p = self.pools.get(pool)
        if p is None or not p.live:
            return None
        return frozenset(a for w in p.workers if w.ready for a in w.adapters)

    def empty_for(self, pool: str) -> float:
        """Seconds the pool has had no worker ready or starting (0 while it has one)."""
        p = self.pools[pool]
        return 0.0 if p.present else self._clock() - p.empty_since

    def starting_for(self, pool: str) -> float:
        """Seconds the pool has been coming up (workers starting, none ready); 0 otherwise."""
        p = self.pools[pool]
        return self._clock() - p.starting_since if p.starting else 0.0

    def what_is_wrong(self, pool: str) -> str:
        return self.pools[pool].what_is_wrong()

    def stranded(self, pool: str) -> bool:
        """A request still waiting for ``pool`` (no worker has it) would be better off elsewhere:
        the pool has no live worker or an open breaker, and its fallback is usable."""
        p = self.pools[pool]
        fallback = self.fallback.get(pool)
        return (not p.live or p.breaker.state is State.OPEN) and fallback is not None and self.pools[fallback].usable()

    def saw_queue(self, reachable: bool) -> None:
        """What a user of the queue just saw (the health check, a probe, a request)."""
        if not reachable:
            self._down_at = self._clock()
        self.queue_down = not reachable

    def saw_writes(self, accepted: bool) -> None:
        """Whether Redis took the health check's write: refused, it is out for writes (heartbeats
        too), though it answers reads."""
        if not accepted:
            self._down_at = self._clock()
        self.writes_refused = not accepted

    def _queue_troubled(self, since: float | None = None) -> bool:
        """The queue is out (or refuses writes), was out after ``since``, or came back less than the
        grace ago: a failure now may be its doing, not the backend's."""
        if self.queue_down or self.writes_refused:
            return True
        if self._down_at is None:
            return False
        recent = self._clock() - self._down_at < self._s.liveness_grace_s
        return recent or (since is not None and self._down_at >= since)

    async def record(self, pool: str, exc: BaseException | None) -> None:
        """The outcome of a real request ``route`` sent to ``pool``."""
        p = self.pools.get(pool)
        if p is None:
            return
        failed = counts_against_backend(exc)
        if isinstance(exc, errors.QueueUnavailable):
            self.saw_queue(False)
        if failed and self._queue_troubled():
            failed = None  # a request that failed around an outage of Redis says nothing of the pool
        if failed is None:
            if p.breaker.state is State.HALF_OPEN:  # give the slot back, learn nothing
                p.breaker.release()
            return
        p.breaker.record(not failed, probe=False, reason=type(exc).__name__ if exc else "")
        if p.breaker.state is State.OPEN:
            p.opened_empty = False  # real requests failed
        await self._publish(p)

    def worker_alive(self, pool: str, worker: str) -> bool:
        p = self.pools.get(pool)
        return p is not None and any(w.worker == worker and not w.failed for w in p.workers)

    # --- probes

    async def refresh(self, p: Pool) -> None:
        was_live, was_present, was_starting = p.live, p.present, p.starting
        # Unknown is not dead: while Redis is out the workers are kept (probes and submits fail
        # meanwhile); and right after it, their heartbeats (expired while it was out) get one round
        # to come back before a worker counts as lost.
        try:
            seen = tuple(await self._queue.workers(p.name))
        except errors.QueueUnavailable:
            p.unreachable = True
            self.saw_queue(False)
        else:
            now = self._clock()
            if p.unreachable or self.writes_refused:  # back (or no heartbeat can be written): what it
                p.kept_until = now + self._s.liveness_grace_s  # knew stands for one more round
            names = {w.worker for w in seen}
            kept = tuple(w for w in p.workers if w.worker not in names) if now < p.kept_until else ()
            p.workers = seen + kept
            p.unreachable = False
            self.saw_queue(True)
            metrics.workers_seen(p.name, (w.state for w in p.workers), (s.value for s in WorkerState))
        if was_present and not p.present:
            p.empty_since = self._clock()
        if p.starting and not was_starting:
            p.starting_since = self._clock()
        p.ever_live = p.ever_live or p.live
        if p.starting and not was_present and p.breaker.state is State.OPEN and p.opened_empty:
            # It opened for want of workers; they are coming up now: requests wait, not refused.
            p.breaker.revive(f"{len(p.workers)} worker(s) starting", close=True)
        elif p.live and not was_live:
            p.breaker.revive(f"{len(p.workers)} live worker(s) again", close=p.opened_empty)
        await self._publish(p)

    async def _probe_loop(self, p: Pool) -> None:
        while not self._stopping:
            await asyncio.sleep(self._s.probe_interval_s)
            if self._stopping:
                return
            try:
                await self.probe(p)
            except Exception as exc:  # a probe must never take the gateway down
                log.exception("probe_crashed", pool=p.name, error=str(exc))

    async def probe(self, p: Pool) -> None:
        """One probe of one pool: heartbeats, then (if anyone is alive and the breaker lets it) a
        one-token generation."""
        started = self._clock()
        await self.refresh(p)
        if p.unreachable:  # Redis is out: nothing to learn about the pool
            return
        if (depth := await self.queue_depth(p.name)) is not None:  # for the metrics, once a probe
            metrics.QUEUE_DEPTH.labels(p.name).set(depth.waiting)
            metrics.QUEUE_PENDING.labels(p.name).set(depth.leased)
        if p.starting:  # coming up: nothing to hold against it
            p.last_probe_error = f"starting: {p.what_is_wrong()}"
            await self._publish(p)
            return
        if not p.live:
            wrong = p.what_is_wrong()
            await self._probe_result(p, "no live worker" + (f" ({wrong})" if wrong else ""))
            return
        if not p.breaker.allow():
            return
        p.probes += 1
        request = GenerationRequest(
            request_id=f"probe~{p.name}~{uuid.uuid4().hex[:12]}",  # "~": in no caller's id
            model="",
            prompt=PROBE_PROMPT,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            accepted_unix_ns=time.time_ns(),
        )
        try:
            error = await asyncio.wait_for(self._one_probe(p.name, request), self._s.probe_timeout_s)
        except asyncio.TimeoutError:
            error = f"no answer in {self._s.probe_timeout_s:g} s"
            with contextlib.suppress(errors.QueueUnavailable):
                await self._queue.cancel(request.request_id)
        except errors.QueueUnavailable:
            self.saw_queue(False)
            return
        if error and self._queue_troubled(since=started):
            log.info("probe_ignored", pool=p.name, error=error, detail="Redis was unreachable during the probe")
            return
        await self._probe_result(p, error)

    async def _one_probe(self, pool: str, request: GenerationRequest) -> str:
        """Submit the probe and follow it to its end: "" or what went wrong."""
        await self._queue.submit(pool, request)
        async for _id, ev in self._queue.events(request.request_id):
            if ev.failed is not None:
                return f"{ev.failed.code}: {ev.failed.message}"
            if ev.terminal:
                return ""
        return "the probe's events ended without a terminal one"

    async def _probe_result(self, p: Pool, error: str) -> None:
        p.last_probe_error = error
        if error and p.breaker.state is not State.OPEN:
            log.warning("probe_failed", pool=p.name, error=error)
        was_open = p.breaker.state is State.OPEN
        p.breaker.record(not error, probe=True, reason=error)
        if p.breaker.state is State.OPEN and not was_open:
            # A pool with no live worker (a cold start, or its workers went away: their requests
            # were counted when they failed) opened for want of one, not for failures of one.
            p.opened_empty = not p.live
        await self._publish(p)

    async def _publish(self, p: Pool) -> None:
        serving = p.serving()
        if self._serving.get(p.name) != serving:
            self._serving[p.name] = serving
            log.info("backend_health_changed", pool=p.name, serving=serving, state=p.breaker.state.value,
                     live_workers=len(p.workers))  # fmt: skip
            if self._on_health is not None:
                await self._on_health(p.name, serving)
