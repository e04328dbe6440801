"""Adaptive batch admission (workers/allowance.py): the allowance halves when the interactive
requests' first tokens miss the target, grows back additively when they meet it, learns a target
from the floor when it has none, and paces batch starts; static admission keeps the ceiling."""

from __future__ import annotations

from llamamesh.settings import BatchSettings
from workers.allowance import BatchAllowance, percentile

SLOTS = 64  # ceiling 32 (max_share 0.5), floor 7 (min_share 0.1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def allowance(**fields: object) -> tuple[BatchAllowance, Clock]:
    clock = Clock()
    return BatchAllowance(BatchSettings(**fields), SLOTS, "test-pool", clock), clock  # type: ignore[arg-type]


def window(a: BatchAllowance, clock: Clock, ttft_s: float | None, running: int, samples: int = 32) -> int:
    """One adapt interval with ``samples`` interactive first tokens of ``ttft_s`` (None: none) and
    ``running`` batch items; the slots judged at its end."""
    a.slots(running)
    for _ in range(samples if ttft_s is not None else 0):
        a.first_token(ttft_s)  # type: ignore[arg-type]
    clock.now += 1.0
    return a.slots(running)


def test_static_admission_is_the_ceiling_whatever_interactive_requests_see() -> None:
    a, clock = allowance(admission="static")
    assert (a.ceiling, a.floor) == (32, 7)
    assert [window(a, clock, 5.0, 32) for _ in range(5)] == [32] * 5
    assert a.startable(20) == 20


def test_it_grows_from_the_floor_to_the_ceiling_while_nothing_interactive_runs() -> None:
    a, clock = allowance()
    assert a.slots(0) == 7
    grown = [window(a, clock, None, 32) for _ in range(12)]
    assert grown[0] == 9 and grown == sorted(grown) and grown[-1] == 32


def test_a_missed_target_cuts_it_down_to_the_floor_and_a_met_one_grows_it_back_additively() -> None:
    a, clock = allowance(interactive_ttft_target_s=0.1)
    for _ in range(12):
        window(a, clock, 0.05, 32)
    assert a.slots(32) == 32
    assert window(a, clock, 0.3, 32) == 22  # x 0.7
    assert window(a, clock, 0.3, 22) == 15
    assert window(a, clock, 0.3, 15) == 10
    assert window(a, clock, 0.3, 10) == 7
    assert window(a, clock, 0.3, 8) == 7  # never below the floor
    assert window(a, clock, 0.05, 7) == 9  # a tenth of the range (25 / 10 -> 2.5) a window
    assert window(a, clock, 0.05, 9) == 12


def test_without_a_target_it_measures_a_baseline_at_the_floor_and_holds_the_signal_to_its_ratio() -> None:
    a, clock = allowance(target_ratio=1.2)
    for _ in range(12):
        window(a, clock, None, 32)  # a batch alone: the ceiling
    assert a.slots(32) == 32 and a.target_s is None
    # Interactive requests arrive with no baseline: it goes to the floor to measure one.
    assert window(a, clock, 0.3, 32) == 7
    assert window(a, clock, 0.1, 7) > 7  # at the floor: 0.1 s is the baseline, and met
    assert a.baseline_s == 0.1 and abs(a.target_s - 0.12) < 1e-9  # type: ignore[operator]
    assert window(a, clock, 0.115, 9) > 9  # within 1.2 x: grows
    before = a.slots(11)
    assert window(a, clock, 0.2, 11) < before  # 2 x the baseline: shrinks


def test_a_window_waits_for_enough_first_tokens_and_too_few_give_no_verdict() -> None:
    a, clock = allowance(interactive_ttft_target_s=0.1)
    for _ in range(12):
        window(a, clock, None, 32)
    assert window(a, clock, 9.0, 32, samples=10) == 32  # 10 of 32: the window goes on
    assert window(a, clock, 9.0, 32, samples=10) == 32
    assert window(a, clock, 9.0, 32, samples=10) == 32
    assert window(a, clock, 9.0, 32, samples=10) == 22  # four intervals, 40 in all: judged
    assert window(a, clock, 9.0, 22, samples=2) == 22
    for _ in range(3):
        window(a, clock, 9.0, 22, samples=1)
    assert a.slots(22) == 24  # four intervals with 5 in all: no verdict, met


def test_batch_starts_are_paced_to_keep_the_allowance_busy_not_started_as_a_cohort() -> None:
    a, clock = allowance(interactive_ttft_target_s=0.1)
    for _ in range(12):
        window(a, clock, None, 0)
    assert a.startable(32) == 32  # no item has ended yet: nothing to pace by
    a.started(32)
    a.item_done(2.0)  # items of 2 s in 32 slots: 16 starts a second keep them busy (x 1.25 = 20)
    clock.now += 0.1
    first = a.startable(32)
    a.started(first)
    assert first == 2  # at most a lease round's (0.1 s) pace at once
    clock.now += 0.15
    assert a.startable(32) == 2  # 0.15 s of 20 a second: 3, but a round's pace at most
    a.started(2)
    clock.now += 0.06
    assert a.startable(32) == 1


def test_percentile_is_the_nearest_rank() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.0
    assert percentile([1.0], 90) == 1.0
