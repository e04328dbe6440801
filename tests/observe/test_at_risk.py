"""llamamesh_batches_at_risk's definition (llamamesh.queue.protocol.batch_at_risk)."""

from __future__ import annotations

from dataclasses import replace

from llamamesh.queue.protocol import batch_at_risk
from llamamesh.types import BatchInfo, BatchState

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
