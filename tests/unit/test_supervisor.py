"""The supervisor's decisions (llamamesh/supervisor.py) over fake processes and a fake clock: restart
with backoff and jitter, the reset after a long run, the crash-loop report, essential children,
the stop. Real processes: tests/workers/test_replicas.py, tests/e2e/test_serve.py."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import IO

import pytest

from llamamesh.supervisor import Backoff, Child, ChildState, Supervisor

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeProcess:
    pid: int
    code: int | None = None
    signals: list[int] = field(default_factory=list)
    # Exits on SIGTERM with this code (None: ignores it, only SIGKILL ends it).
    on_term: int | None = 0

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.code = -9
        elif sig == signal.SIGTERM and self.on_term is not None:
            self.code = self.on_term


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def supervisor(
    *children: Child, backoff: Backoff | None = None, rand: float = 0.5
) -> tuple[Supervisor, Clock, list[FakeProcess]]:
    clock = Clock()
    started: list[FakeProcess] = []

    def launch(child: Child, output: IO[bytes] | None) -> FakeProcess:
        started.append(FakeProcess(pid=1000 + len(started)))
        return started[-1]

    exits: list[ChildState] = []
    sup = Supervisor(
        list(children), backoff or Backoff(), clock=clock, rand=lambda: rand, launch=launch, on_exit=exits.append
    )
    sup.exits = exits  # type: ignore[attr-defined]
    return sup, clock, started


WORKER = Child("worker-0", ("python", "-m", "workers"), {})
GATEWAY = Child("gateway", ("python", "-m", "services"), {}, essential=True)


def test_the_delay_doubles_from_first_to_max_with_jitter() -> None:
    b = Backoff(first_s=1.0, max_s=30.0, jitter=0.25)
    assert [b.delay(n, 0.5) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert b.delay(1, 0.0) == 0.75 and b.delay(1, 0.999999) == pytest.approx(1.25)
    assert b.delay(7, 0.0) == 22.5  # jitter applies at the cap too


def test_a_child_that_exits_is_started_again_after_its_backoff() -> None:
    sup, clock, started = supervisor(WORKER, GATEWAY)
    sup.start()
    assert len(started) == 2
    started[0].code = -9  # kill -9 of the worker
    assert sup.step() is None
    state = sup.states["worker-0"]
    assert state.restart_at == 101.0 and state.last_exit == -9 and state.quick_exits == 1
    assert sup.exits == [state]  # type: ignore[attr-defined]
    clock.now = 100.9
    assert sup.step() is None and len(started) == 2  # not before its time
    clock.now = 101.0
    assert sup.step() is None and len(started) == 3 and state.process is started[2]
    assert state.starts == 2 and state.restart_at is None


def test_quick_exits_back_off_and_are_reported_then_a_long_run_resets() -> None:
    sup, clock, started = supervisor(WORKER, backoff=Backoff(first_s=1, max_s=8, report_after=4, reset_after_s=60))
    sup.start()
    delays = []
    for _ in range(5):
        started[-1].code = 1
        sup.step()
        state = sup.states["worker-0"]
        assert state.restart_at is not None
        delays.append(state.restart_at - clock.now)
        clock.now = state.restart_at
        sup.step()
    assert delays == [1, 2, 4, 8, 8]
    assert [s.name for s in sup.crash_looping()] == ["worker-0"]
    clock.now += 61  # this run lasted: the next exit starts the count again
    started[-1].code = 1
    sup.step()
    assert state.quick_exits == 1 and state.restart_at == clock.now + 1 and not state.crash_looping


def test_an_essential_child_or_watched_process_ending_ends_the_set() -> None:
    sup, _clock, started = supervisor(WORKER, GATEWAY)
    sup.start()
    started[1].code = 0  # the gateway ended, even cleanly: the node cannot serve
    assert sup.step() == 1
    sup2, _c, _s = supervisor(WORKER)
    sup2.start()
    redis = FakeProcess(pid=7)
    sup2.watch("redis", redis)
    assert sup2.step() is None
    redis.code = 137
    assert sup2.step() == 137


def test_stop_terms_everything_then_kills_what_stays() -> None:
    sup, clock, started = supervisor(WORKER, GATEWAY)
    sup.start()
    started[0].on_term = None  # ignores SIGTERM
    watched = FakeProcess(pid=7)
    sup.watch("redis", watched)
    clock.now += 1000  # the grace is already over when stop() looks: no real waiting in this test
    assert sup.stop(grace_s=0.0) == 1
    assert started[0].signals == [signal.SIGTERM, signal.SIGKILL]
    assert started[1].signals == [signal.SIGTERM]
    assert watched.signals == []  # its owner stops it


def test_nothing_restarts_once_stopping() -> None:
    sup, clock, started = supervisor(WORKER)
    sup.start()
    started[0].code = 1
    sup.step()
    sup.stopping = True
    clock.now += 100
    sup.step()
    assert len(started) == 1


def test_a_signal_while_stopping_goes_on_to_the_children_not_the_end_of_the_supervisor() -> None:
    """A second SIGTERM (an impatient operator, a process manager) while the children drain: each
    running child gets it too, and the supervisor waits for them as before instead of dying of it
    and leaving them behind."""
    raised: list[bool] = []

    @dataclass
    class Draining(FakeProcess):
        def poll(self) -> int | None:
            if self.signals == [signal.SIGTERM] and not raised:  # draining: the second signal comes
                raised.append(True)
                signal.raise_signal(signal.SIGTERM)
            return self.code

        def send_signal(self, sig: int) -> None:
            self.signals.append(sig)
            self.code = 0 if len(self.signals) == 2 else None  # the second signal ends its drain

    sup = Supervisor([GATEWAY], launch=lambda child, output: Draining(pid=1, on_term=None))
    sup.start()
    ended_here: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: ended_here.append(signum))  # (the default ends us)
    try:
        assert sup.stop(grace_s=30.0) == 0
        assert signal.getsignal(signal.SIGTERM) is not None and not ended_here
    finally:
        signal.signal(signal.SIGTERM, old)
    (child,) = [s.process for s in sup.states.values()]
    assert isinstance(child, Draining) and child.signals == [signal.SIGTERM, signal.SIGTERM]


def test_the_children_named_first_stop_before_the_others() -> None:
    """A node's gateway drains while its workers still run what it accepts: they get their SIGTERM
    only once it exited."""
    sup, _clock, started = supervisor(GATEWAY, WORKER)
    sup.start()
    gateway, worker = started
    seen: list[int | None] = []
    worker_signal = worker.send_signal

    def note_the_gateway_then_signal(sig: int) -> None:
        seen.append(gateway.code)
        worker_signal(sig)

    worker.send_signal = note_the_gateway_then_signal  # type: ignore[method-assign]
    assert sup.stop(grace_s=30.0, first=("gateway",)) == 0
    assert seen == [0] and gateway.signals == [signal.SIGTERM] and worker.signals == [signal.SIGTERM]
