"""The gateway's view of its backend pools (``Backends``): where a request goes, what its outcome
says of the pool, and the pool's health (``llamamesh.backend.<pool>``: a live worker and a breaker
not open). One per gateway process; it owns the probes (services/probes.py) that read the pools
through the queue, and the view of Redis's outages (services/outage.py). How routing, breakers and
fallback work together: docs/architecture.md ("Health, breakers and fallback").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import structlog

from llamamesh import errors, metrics
from llamamesh.queue.protocol import ProbeQueue, QueueDepth
from llamamesh.settings import BreakerSettings
from services.breaker import Breaker, State
from services.outage import QueueOutage
from services.pool import Pool, TokenRate
from services.probes import Probes

log = structlog.get_logger(__name__)


def backend_service(pool: str) -> str:
    """The grpc.health.v1 service name of a pool."""
    return f"llamamesh.backend.{pool}"


def counts_against_backend(exc: BaseException | None) -> bool | None:
    """True: a failure of the backend (lost worker, engine failure, internal error, timeout); False: a
    success; None: neither (client errors: bad input, unknown model, cancellation; or Redis's)."""
    if exc is None:
        return False
    if isinstance(exc, errors.ClientError | errors.CapacityError | errors.DeadlineUnreachable | asyncio.CancelledError):
        return None
    if isinstance(exc, errors.QueueUnavailable):  # Redis, not the backend
        return None
    return True


# How fast a pool's measured queue wait fades when no request adds to it (seconds to halve).
WAIT_HALF_LIFE_S = 10.0


class Backends:
    """Every pool of one gateway process: its breaker, its live workers, its health. A request goes
    to its model's pool unless that pool is unusable (breaker open, or no live worker), then to the
    pool's configured fallback (``LLAMAMESH_GATEWAY_FALLBACK``, e.g. ``trtllm=vllm,vllm=trtllm``) if
    that one is usable, before any token is sent. A pool whose workers are all still starting has
    NOT_SERVING health, and requests wait for it (``GatewaySettings.start_wait_s``)."""

    def __init__(
        self,
        queue: ProbeQueue,
        pools: Sequence[str],
        fallback: Mapping[str, str],
        settings: BreakerSettings,
        on_health: Callable[[str, bool], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._s = settings
        self.fallback = dict(fallback)
        names = list(dict.fromkeys([*pools, *self.fallback, *self.fallback.values()]))
        self._clock = clock
        self.pools = {
            p: Pool(p, Breaker(p, settings, clock=clock), empty_since=clock(), tokens=TokenRate(clock)) for p in names
        }
        for p in names:
            metrics.BREAKER_STATE.labels(p).set(0)
            # Counted from 0 before their first event, so that increase() over a window sees the first one.
            metrics.FAILOVERS.labels(p)
            metrics.DEAD_LETTERS.labels(p)
        self._on_health = on_health
        self._serving: dict[str, bool] = {}
        self.outage = QueueOutage(settings.liveness_grace_s, clock)
        self.probes = Probes(queue, settings, self.outage, self._publish, clock)

    # --- lifecycle

    async def start(self) -> None:
        """Read every pool once (so the first requests route on facts), then probe in the background."""
        await asyncio.gather(*(self.refresh(p) for p in self.pools.values()))
        self.probes.start(self.pools.values())

    async def stop(self) -> None:
        await self.probes.stop()

    async def refresh(self, p: Pool) -> None:
        """Read the pool's heartbeats now (services/probes.py)."""
        await self.probes.refresh(p)

    async def probe(self, p: Pool) -> None:
        """Probe the pool now (services/probes.py)."""
        await self.probes.probe(p)

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
                    log.info(
                        "request_fallback",
                        pool=pool,
                        to=candidate,
                        state=self.pools[pool].breaker.state.value,
                        live_workers=len(self.pools[pool].workers),
                    )
                return candidate
        p = self.pools[pool]
        if p.breaker.allow():
            return pool
        why = "is failing (circuit open)" if p.live else "has no live worker (circuit open)"
        raise errors.NoWorkers(
            f"the backend pool {pool!r} {why}"
            + (f" and its fallback {fallback!r} cannot take requests" if fallback else "")
        )

    def stranded(self, pool: str) -> bool:
        """A request still waiting for ``pool`` (no worker has it) would be better off elsewhere:
        the pool has no live worker or an open breaker, and its fallback is usable."""
        p = self.pools[pool]
        fallback = self.fallback.get(pool)
        return (not p.live or p.breaker.state is State.OPEN) and fallback is not None and self.pools[fallback].usable()

    def worker_alive(self, pool: str, worker: str) -> bool:
        p = self.pools.get(pool)
        return p is not None and any(w.worker == worker and not w.failed for w in p.workers)

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

    # --- figures

    def observe_queue_wait(self, pool: str, seconds: float) -> None:
        p = self.pools.get(pool)
        if p is not None:
            p.queue_wait_s = seconds if not p.waits else 0.8 * p.queue_wait_s + 0.2 * seconds
            p.waits += 1
            p.wait_seen_at = self._clock()

    def expected_queue_wait(self, pool: str) -> float:
        """The pool's recent queue wait in seconds: 0 until it has a few samples, and while a worker
        has a free slot; halved for every ``WAIT_HALF_LIFE_S`` without a new sample (a wait measured
        in a burst says little once nothing finishes: it must not refuse every request after it)."""
        p = self.pools[pool]
        if p.waits < 5 or p.has_room():
            return 0.0
        return p.queue_wait_s * 0.5 ** ((self._clock() - p.wait_seen_at) / WAIT_HALF_LIFE_S)

    def count_tokens(self, pool: str, n: int) -> None:
        """``n`` tokens of ``pool`` reached a caller (for ``tokens_per_s``)."""
        p = self.pools.get(pool)
        if p is not None:
            p.tokens.add(n)

    async def queue_depth(self, pool: str) -> QueueDepth | None:
        """The pool's jobs waiting and leased now; None while the queue is unreachable."""
        return await self.probes.queue_depth(pool)

    # --- outcomes

    @property
    def queue_down(self) -> bool:
        return self.outage.down

    @property
    def writes_refused(self) -> bool:
        return self.outage.writes_refused

    def saw_queue(self, reachable: bool) -> None:
        """What a user of the queue just saw (the health check, a probe, a request)."""
        self.outage.saw_queue(reachable)

    def saw_writes(self, accepted: bool) -> None:
        """Whether Redis took the health check's write (services/outage.py)."""
        self.outage.saw_writes(accepted)

    async def record(self, pool: str, exc: BaseException | None) -> None:
        """The outcome of a real request ``route`` sent to ``pool``, for its breaker: failures of the
        backend count; client errors never do, nor failures around an outage of Redis."""
        p = self.pools.get(pool)
        if p is None:
            return
        failed = counts_against_backend(exc)
        if isinstance(exc, errors.QueueUnavailable):
            self.outage.saw_queue(False)
        if failed and self.outage.troubled():
            failed = None  # a request that failed around an outage of Redis says nothing of the pool
        if failed is None:
            if p.breaker.state is State.HALF_OPEN:  # give the slot back, learn nothing
                p.breaker.release()
            return
        p.breaker.record(not failed, probe=False, reason=type(exc).__name__ if exc else "")
        if p.breaker.state is State.OPEN:
            p.opened_empty = False  # real requests failed
        await self._publish(p)

    async def _publish(self, p: Pool) -> None:
        """Tell the pool's health when it changed."""
        serving = p.serving()
        if self._serving.get(p.name) != serving:
            self._serving[p.name] = serving
            log.info(
                "backend_health_changed",
                pool=p.name,
                serving=serving,
                state=p.breaker.state.value,
                live_workers=len(p.workers),
            )
            if self._on_health is not None:
                await self._on_health(p.name, serving)
