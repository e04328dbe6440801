"""A batch item's run on the worker: its result and the timings its log line carries."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from llamamesh.queue.memory import MemoryBatches
from llamamesh.settings import WorkerSettings
from llamamesh.types import BatchInfo, BatchState, FinishReason, GenerationRequest, SamplingParams
from workers.batch import run_batch_item
from workers.engines.fake import FakeEngine
from workers.samples import Samples

pytestmark = pytest.mark.timeout(30)


async def test_a_finished_item_logs_when_it_started_how_long_it_ran_and_its_first_token() -> None:
    store = MemoryBatches()
    await store.join("cpu")
    now = time.time()
    accepted = time.time_ns()
    info = BatchInfo(
        batch_id="b",
        state=BatchState.VALIDATING,
        owner="t",
        model="m",
        total=1,
        completion_window_s=3600,
        created_at=now,
        expires_at=now + 3600,
    )
    req = GenerationRequest(
        request_id="b:b:0",
        model="m",
        prompt="hello there",
        sampling=SamplingParams(max_tokens=4),
        batch_id="b",
        custom_id="c0",
        accepted_unix_ns=accepted,
    )
    await store.create(info, "fp", [("cpu", req)])
    (lease,) = await store.lease_items("cpu", "w", 1, None)
    engine = FakeEngine(WorkerSettings(pool="cpu", engine="fake", fake_step_s=0.01))
    await engine.start()
    with capture_logs() as logs:
        await run_batch_item(lease, Samples(engine), store)
    (line,) = [x for x in logs if x["event"] == "batch_item_finished"]
    assert line["status"] == "succeeded" and line["custom_id"] == "c0"
    assert 0 <= line["start_ms"] <= (time.time_ns() - accepted) / 1e6
    # four tokens at one per 10 ms step: the first after one step, the last after four
    assert 5 <= line["first_token_ms"] <= line["duration_ms"]
    assert line["duration_ms"] >= 30
    info_after = await store.get("b")
    assert info_after is not None and info_after.succeeded == 1


async def test_an_item_of_n_samples_records_each_samples_text_and_finish() -> None:
    store = MemoryBatches()
    await store.join("cpu")
    now = time.time()
    info = BatchInfo(
        batch_id="b",
        state=BatchState.VALIDATING,
        owner="t",
        model="m",
        total=1,
        completion_window_s=3600,
        created_at=now,
        expires_at=now + 3600,
    )
    req = GenerationRequest(
        request_id="b:b:0",
        model="m",
        prompt="hi",
        batch_id="b",
        custom_id="c0",
        sampling=SamplingParams(max_tokens=5, n=3, seed=10, stop=(" w16",)),
    )
    await store.create(info, "fp", [("cpu", req)])
    (lease,) = await store.lease_items("cpu", "w", 1, None)
    engine = FakeEngine(WorkerSettings(pool="cpu", engine="fake"))
    await engine.start()
    await run_batch_item(lease, Samples(engine), store)
    ((_cursor, result),) = await store.results("b", "0-0", None)
    # sample k of seed 10 is the fake's tokens 11 + k, ...: " w16" stops samples 1 and 2
    assert result.samples == (
        (" w11 w12 w13 w14 w15", FinishReason.LENGTH),
        (" w12 w13 w14 w15", FinishReason.STOP_SEQUENCE),
        (" w13 w14 w15", FinishReason.STOP_SEQUENCE),
    )
    assert (result.text, result.finish_reason) == result.samples[0]
    assert result.usage.completion_tokens == 5 + 5 + 4
