"""The circuit breaker's state machine, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from llamamesh import errors
from llamamesh.settings import BreakerSettings
from services.backends import counts_against_backend
from services.breaker import Breaker, State

S = BreakerSettings(
    probe_failures=3, error_rate=0.5, window=10, min_requests=4, open_s=5.0, half_open_max=2, half_open_successes=2
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def breaker() -> tuple[Breaker, Clock]:
    clock = Clock()
    return Breaker("p", S, clock=clock, wall=clock), clock


def test_three_consecutive_failed_probes_open_it_and_a_success_resets_the_count() -> None:
    b, _ = breaker()
    b.record(False, probe=True)
    b.record(False, probe=True)
    b.record(True, probe=True)
    b.record(False, probe=True)
    b.record(False, probe=True)
    assert b.state is State.CLOSED
    b.record(False, probe=True, reason="no live worker")
    assert b.state is State.OPEN
    assert [(t.old, t.new) for t in b.transitions] == [(State.CLOSED, State.OPEN)]
    assert "no live worker" in b.transitions[0].reason


def test_error_rate_over_the_window_of_real_requests() -> None:
    b, _ = breaker()
    for ok in (True, False, True):  # 1 of 3: under min_requests anyway
        b.record(ok, probe=False)
    assert b.state is State.CLOSED
    b.record(True, probe=False)  # 1 of 4 = 25 %
    assert b.state is State.CLOSED
    b.record(False, probe=False)  # 2 of 5 = 40 %
    assert b.state is State.CLOSED
    b.record(False, probe=False)  # 3 of 6 = 50 %
    assert b.state is State.OPEN


def test_the_window_forgets_old_failures() -> None:
    b, _ = breaker()
    for outcomes in ([True] * 10, [False] * 3, [True] * 10, [False] * 4):
        for ok in outcomes:
            b.record(ok, probe=False)
    assert b.state is State.CLOSED  # 7 failures of the last 27, but 4 of the 10 in the window
    b.record(False, probe=False)
    assert b.state is State.OPEN  # 5 of 10


def test_open_refuses_until_open_s_then_half_open_lets_a_bounded_number_through() -> None:
    b, clock = breaker()
    for _ in range(3):
        b.record(False, probe=True)
    assert not b.allow() and not b.available()
    clock.t += 4.9
    assert not b.allow()
    clock.t += 0.2
    assert b.available()
    assert b.allow() and b.state is State.HALF_OPEN
    assert b.allow()
    assert not b.allow() and not b.available()  # half_open_max = 2 at a time
    b.record(True, probe=False)
    assert b.state is State.HALF_OPEN
    assert b.allow()  # the slot came back
    b.record(True, probe=True)
    assert b.state is State.CLOSED
    assert [(t.old.value, t.new.value) for t in b.transitions] == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "closed"),
    ]


def test_a_failure_while_half_open_opens_it_again_for_open_s() -> None:
    b, clock = breaker()
    for _ in range(3):
        b.record(False, probe=True)
    clock.t += 5
    assert b.allow()
    b.record(False, probe=False, reason="EngineDead")
    assert b.state is State.OPEN
    assert not b.allow()
    clock.t += 5
    assert b.allow() and b.state is State.HALF_OPEN


def test_released_half_open_slots_teach_nothing() -> None:
    b, clock = breaker()
    for _ in range(3):
        b.record(False, probe=True)
    clock.t += 5
    assert b.allow() and b.allow() and not b.allow()
    b.release()
    b.release()
    assert b.state is State.HALF_OPEN
    assert b.allow()


def test_stragglers_recorded_while_open_change_nothing() -> None:
    b, _ = breaker()
    for _ in range(3):
        b.record(False, probe=True)
    b.record(True, probe=False)
    b.record(True, probe=True)
    assert b.state is State.OPEN and len(b.transitions) == 1


@pytest.mark.parametrize(
    ("exc", "verdict"),
    [
        (None, False),
        (errors.InvalidRequest.field("top_p", "bad"), None),
        (errors.PromptTooLong.field("prompt", "long"), None),
        (errors.NotFound("model"), None),
        (asyncio.CancelledError(), None),
        (errors.QueueFull("full"), None),
        (errors.WorkerLost("gone"), True),
        (errors.EngineDead("dead"), True),
        (errors.InternalError("bug"), True),
        (errors.DeadlineExceeded("slow"), True),
    ],
)
def test_only_the_backends_failures_count(exc: BaseException | None, verdict: bool | None) -> None:
    assert counts_against_backend(exc) is verdict


def test_a_worker_appearing_revives_an_open_breaker_at_once() -> None:
    b, _ = breaker()
    for _ in range(3):
        b.record(False, probe=True, reason="no live worker")
    b.revive("1 live worker(s) again")
    assert b.state is State.HALF_OPEN and b.allow()
    b.revive("again")  # only an open breaker is revived
    assert [t.new for t in b.transitions] == [State.OPEN, State.HALF_OPEN]
