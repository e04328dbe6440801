"""``llamamesh top``'s frame from a hand-built ListBackendsResponse, and the gateway's token rate."""

from __future__ import annotations

import pytest

from llamamesh.cli import top
from llamamesh.v1 import admin_pb2 as pb
from services.backends import TokenRate

pytestmark = pytest.mark.timeout(10)


def response() -> pb.ListBackendsResponse:
    cpu = pb.Backend(
        pool="cpu",
        breaker_state="closed",
        serving=True,
        fallback="gpu",
        queue_depth=7,
        queue_pending=3,
        queue_wait_s=1.25,
        tokens_per_s=42.5,
    )
    cpu.workers.add(
        name="w-1",
        model="tiny",
        engine="fake",
        inflight=3,
        max_inflight=4,
        running=3,
        waiting=0,
        kv_cache_usage=0.5,
        state="ready",
    )
    cpu.workers.add(
        name="w-2", model="tiny", engine="fake", max_inflight=4, state="starting", detail="loading the model"
    )
    gpu = pb.Backend(pool="gpu", breaker_state="open", serving=False, last_probe_error="no live worker")
    gpu.workers.add(name="g-1", engine="vllm", state="failed", detail="CUDA out of memory")
    gpu.transitions.add(from_state="closed", to_state="open", reason="5 failures")
    return pb.ListBackendsResponse(backends=[cpu, gpu])


def cells(frame: str, first: str) -> list[str]:
    """The cells of the frame's line that starts with ``first``."""
    line = next(ln for ln in frame.splitlines() if ln.split() and ln.split()[0] == first)
    return line.split()


def test_a_pool_line_counts_workers_by_state_slots_queue_and_rate() -> None:
    frame = top.render(response(), title="llamamesh top  here  12:00:00")
    assert frame.splitlines()[0] == "llamamesh top  here  12:00:00"
    assert cells(frame, "POOL") == [c for col in top.POOL_COLUMNS for c in col.split()]
    # ready starting failed | in flight over the ready workers' slots | queued leased wait tok/s fallback
    assert cells(frame, "cpu") == ["cpu", "closed", "yes", "1", "1", "0", "3/4", "7", "3", "1.25s", "42.5", "gpu"]
    assert cells(frame, "gpu") == ["gpu", "open", "no", "0", "0", "1", "0/0", "?", "?", "0.00s", "0.0", "-"]


def test_workers_and_what_is_wrong_follow_each_pool() -> None:
    frame = top.render(response())
    assert cells(frame, "w-1") == ["w-1", "ready", "fake", "tiny", "3/4", "3", "0", "50%"]
    assert cells(frame, "w-2") == ["w-2", "starting", "fake", "tiny", "0/4", "0", "0", "0%", "loading", "the", "model"]
    assert "CUDA out of memory" in next(ln for ln in frame.splitlines() if "g-1" in ln)
    gpu = next(ln for ln in frame.splitlines() if ln.startswith("gpu:"))
    assert "breaker closed -> open: 5 failures" in gpu and "last probe: no live worker" in gpu
    assert next(ln for ln in frame.splitlines() if ln.startswith("cpu:")) == "cpu: 2 worker(s)"


def test_no_pools() -> None:
    assert top.render(pb.ListBackendsResponse()) == "no backend pools\n"


def test_token_rate_is_the_mean_of_the_last_whole_seconds() -> None:
    now = [100.2]
    rate = TokenRate(lambda: now[0], window_s=5)
    for _ in range(10):
        rate.add(3)
    assert rate.per_s() == 0.0  # the current second is not over
    now[0] = 101.5
    rate.add(20)
    assert rate.per_s() == 30 / 5
    now[0] = 102.0
    assert rate.per_s() == 50 / 5
    now[0] = 106.9  # second 100 has left the window, 101 has not
    assert rate.per_s() == 20 / 5
    now[0] = 112.0  # a slot reused after a lap starts again from zero
    rate.add(1)
    assert rate.per_s() == 0.0
    now[0] = 113.0
    assert rate.per_s() == 1 / 5
