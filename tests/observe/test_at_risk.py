"""The open batches' gauges: at risk (llamamesh.types.batches.batch_at_risk), projected late
(projected_finish), as the gateway's batch sweeper sets them."""

from __future__ import annotations

from dataclasses import replace

import structlog
from prometheus_client import REGISTRY

from llamamesh.queue.memory import MemoryBatches
from llamamesh.types import BatchInfo, BatchState
from llamamesh.types.batches import batch_at_risk, projected_finish
from services.batch_sweeper import BatchSweeper

NOW = 1_000_000.0
WINDOW = 86_400


def batch(left_s: float, state: BatchState = BatchState.IN_PROGRESS, succeeded: int = 0) -> BatchInfo:
    return BatchInfo(
        batch_id="b",
        state=state,
        owner="o",
        model="m",
        total=10,
        completion_window_s=WINDOW,
        created_at=NOW + left_s - WINDOW,
        expires_at=NOW + left_s,
        succeeded=succeeded,
    )


def test_an_open_batch_with_unfinished_items_and_under_a_tenth_of_its_window_left_is_at_risk() -> None:
    assert batch_at_risk(batch(0.05 * WINDOW), NOW, 0.1)
    assert not batch_at_risk(batch(0.5 * WINDOW), NOW, 0.1)


def test_finished_cancelling_ended_or_past_deadline_batches_are_not() -> None:
    assert not batch_at_risk(batch(0.05 * WINDOW, succeeded=10), NOW, 0.1)
    assert not batch_at_risk(batch(0.05 * WINDOW, BatchState.CANCELLING), NOW, 0.1)
    assert not batch_at_risk(batch(0.05 * WINDOW, BatchState.COMPLETED), NOW, 0.1)
    assert not batch_at_risk(replace(batch(0.05 * WINDOW), expires_at=NOW - 1), NOW, 0.1)


def test_a_batch_is_projected_to_finish_at_the_rate_its_items_have_ended_so_far() -> None:
    b = replace(batch(0.5 * WINDOW), total=10, succeeded=4, created_at=NOW - 400)  # 4 in 400 s: 6 more in 600 s
    assert projected_finish(b, NOW) == NOW + 600
    assert projected_finish(batch(0.5 * WINDOW), NOW) is None  # nothing ended yet: no rate
    assert projected_finish(batch(0.5 * WINDOW, succeeded=10), NOW) is None
    assert projected_finish(replace(b, state=BatchState.CANCELLING), NOW) is None


def test_the_sweeper_counts_the_batches_projected_late_and_logs_each_once() -> None:
    sweeper = BatchSweeper(MemoryBatches(), 5.0)
    on_time = replace(batch(0.5 * WINDOW), batch_id="on-time", succeeded=9, created_at=NOW - 100)
    late = replace(batch(100), batch_id="late", succeeded=1, created_at=NOW - WINDOW + 100)
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            sweeper._watch([on_time, late], NOW)
    assert REGISTRY.get_sample_value("llamamesh_batches_projected_late") == 1
    assert REGISTRY.get_sample_value("llamamesh_batch_projected_finish_ratio") > 1  # type: ignore[operator]
    assert REGISTRY.get_sample_value("llamamesh_batches_at_risk") == 1
    assert [x["batch_id"] for x in logs if x["event"] == "batch_projected_late"] == ["late"]
    sweeper._watch([on_time], NOW)
    assert REGISTRY.get_sample_value("llamamesh_batches_projected_late") == 0
