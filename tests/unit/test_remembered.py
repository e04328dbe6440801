"""Engines keep the recent request ids they aborted, not every one (a worker runs for days)."""

from __future__ import annotations

import pytest

from workers.engines.base import remember

pytestmark = pytest.mark.timeout(10)


def test_the_list_of_remembered_ids_stays_bounded_and_keeps_the_newest() -> None:
    ids: list[str] = []
    for i in range(10_000):
        remember(ids, f"r{i}", keep=100)
    assert len(ids) <= 200 and ids[-1] == "r9999" and ids == [f"r{i}" for i in range(10_000 - len(ids), 10_000)]
