"""A Redis outage is not a backend failure (services/backends.py), and the retry delays of the
queue's users are jittered (llamamesh/backoff.py). In-memory queue, a hand-driven clock."""

from __future__ import annotations

import pytest

from llamamesh import errors
from llamamesh.backoff import Delays
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import BreakerSettings
from llamamesh.types import WorkerStatus
from services.backends import Backends
from services.breaker import State

pytestmark = pytest.mark.timeout(10)

S = BreakerSettings(probe_failures=3, error_rate=0.5, window=4, min_requests=2, open_s=60, liveness_grace_s=3.0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def pool_of(*workers: str) -> tuple[Backends, MemoryQueue, Clock]:
    q, clock = MemoryQueue(), Clock()
    for w in workers:
        await q.heartbeat(WorkerStatus(worker=w, pool="cpu"), ttl_s=60)
    b = Backends(q, ["cpu"], {}, S, clock=clock)
    await b.refresh(b.pools["cpu"])
    return b, q, clock


async def test_requests_that_fail_because_redis_is_out_never_open_the_breaker() -> None:
    b, _q, clock = await pool_of("w1")
    for _ in range(10):
        await b.record("cpu", errors.QueueUnavailable("the queue is unreachable"))
    assert b.pools["cpu"].breaker.state is State.CLOSED
    # Workers lost while Redis was out, or just after it came back, say nothing of the pool either.
    for _ in range(10):
        await b.record("cpu", errors.WorkerLost("stopped answering", running=True))
    assert b.pools["cpu"].breaker.state is State.CLOSED
    clock.t += S.liveness_grace_s + 0.1
    b.saw_queue(True)
    for _ in range(4):  # long after: real failures count again
        await b.record("cpu", errors.WorkerLost("stopped answering", running=True))
    assert b.pools["cpu"].breaker.state is State.OPEN


async def test_probes_during_an_outage_record_nothing() -> None:
    b, q, _clock = await pool_of("w1")
    p = b.pools["cpu"]
    q.down = True
    for _ in range(5):
        await b.probe(p)
    assert p.breaker.state is State.CLOSED and p.live  # the workers known before it are kept
    assert b.queue_down


async def test_a_worker_whose_heartbeat_expired_during_the_outage_gets_a_round_to_come_back() -> None:
    b, q, clock = await pool_of("w1", "w2")
    p = b.pools["cpu"]
    q.down = True
    await b.refresh(p)
    assert b.worker_alive("cpu", "w1") and b.worker_alive("cpu", "w2")
    q.down = False
    await q.leave("cpu", "w2")  # its heartbeat key expired while Redis was out
    await b.refresh(p)
    assert b.worker_alive("cpu", "w2")  # not lost yet: it has the grace to heartbeat again
    clock.t += 1.0
    await b.refresh(p)
    assert b.worker_alive("cpu", "w2")
    clock.t += S.liveness_grace_s
    await b.refresh(p)
    assert b.worker_alive("cpu", "w1") and not b.worker_alive("cpu", "w2")  # it never came back


async def test_a_worker_that_leaves_with_redis_up_is_gone_at_once() -> None:
    b, q, _clock = await pool_of("w1", "w2")
    await q.leave("cpu", "w2")
    await b.refresh(b.pools["cpu"])
    assert not b.worker_alive("cpu", "w2")


def test_delays_double_to_the_cap_with_jitter_and_reset() -> None:
    lo = Delays(first_s=0.1, cap_s=1.0, jitter=0.5, rand=lambda: 0.0)
    hi = Delays(first_s=0.1, cap_s=1.0, jitter=0.5, rand=lambda: 0.999999)
    assert Delays().cap_s <= 0.5  # the default: retries reach a Redis that is back within ~0.6 s
    assert [round(lo.next(), 3) for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert [round(hi.next(), 2) for _ in range(6)] == [0.15, 0.3, 0.6, 1.2, 1.5, 1.5]
    lo.reset()
    assert round(lo.next(), 3) == 0.05
    spread = {round(Delays(first_s=1.0).next(), 6) for _ in range(20)}
    assert len(spread) > 10  # a fleet retrying after a restart does not do it in lockstep
