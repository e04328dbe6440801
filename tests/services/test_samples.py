"""GenerateRequest.n through the gateway, the queue and a worker (the fake engine: each sample is its
own engine request there, workers/samples.py): which sample each message carries, each sample's
finish, usage of all, Cancel, deadline, Attach with per-sample offsets, and the failover of a request
of several samples (each unfinished sample resumed from its own tokens)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterable

import grpc
import pytest

from llamamesh.client import field_violations
from llamamesh.types import Finished, FinishReason, JobEvent, Usage
from llamamesh.v1 import generation_pb2 as pb
from tests.services.conftest import Stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


class Samples:
    """A response stream split by sample: each sample's token ids, indexes and finish reason."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = defaultdict(list)
        self.idx: dict[int, list[int]] = defaultdict(list)
        self.text: dict[int, str] = defaultdict(str)
        self.finish: dict[int, int] = {}
        self.last: pb.GenerateResponse | None = None

    def add(self, m: pb.GenerateResponse) -> None:
        assert m.sample not in self.finish, f"sample {m.sample} sent a message after its end"
        self.ids[m.sample] += m.token_ids
        self.idx[m.sample] += range(m.index, m.index + len(m.token_ids))
        self.text[m.sample] += m.text
        if m.finish_reason:
            self.finish[m.sample] = m.finish_reason
        self.last = m

    @classmethod
    async def read(cls, stream: AsyncIterable[pb.GenerateResponse]) -> Samples:
        out = cls()
        async for m in stream:
            out.add(m)
        return out


async def test_n_samples_each_numbered_ended_and_counted(stack: Stack) -> None:
    got = await Samples.read(stack.stub.Generate(pb.GenerateRequest(prompt="three ways", max_tokens=6, n=3, seed=10)))
    assert sorted(got.ids) == [0, 1, 2]
    for k in range(3):
        assert got.idx[k] == list(range(6)) and got.finish[k] == pb.FINISH_REASON_LENGTH
        assert got.text[k] == "".join(f" w{t}" for t in got.ids[k])
    assert len({tuple(v) for v in got.ids.values()}) == 3  # three different samples
    assert got.last is not None and got.last.usage.completion_tokens == 18 and got.last.usage.prompt_tokens == 2
    # Sample k of seed s is what one request with seed s + k generates (vLLM's rule for n).
    for k in range(3):
        one_req = pb.GenerateRequest(prompt="three ways", max_tokens=6, seed=10 + k)
        one = await Samples.read(stack.stub.Generate(one_req))
        assert one.ids[0] == got.ids[k] and set(one.ids) == {0}
    assert stack.queue.pending("cpu") == {}


async def test_each_sample_ends_with_its_own_finish_reason(stack: Stack) -> None:
    # Sample k of seed 10 is the fake's tokens 11 + k, 12 + k, ...: " w16" stops samples 1 and 2 only.
    got = await Samples.read(
        stack.stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=5, n=3, seed=10, stop=[" w16"]))
    )
    assert got.finish == {
        0: pb.FINISH_REASON_LENGTH,
        1: pb.FINISH_REASON_STOP_SEQUENCE,
        2: pb.FINISH_REASON_STOP_SEQUENCE,
    }
    assert got.ids == {0: [11, 12, 13, 14, 15], 1: [12, 13, 14, 15, 16], 2: [13, 14, 15, 16]}
    assert got.last is not None and got.last.usage.completion_tokens == 14


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"n": 0}, "[1, 16]"), ({"n": 17}, "[1, 16]"), ({"n": 2, "temperature": 0.0}, "greedy")],
)
async def test_bad_n_is_invalid_argument_naming_n(stack: Stack, fields: dict, why: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await Samples.read(stack.stub.Generate(pb.GenerateRequest(prompt="x", **fields)))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(ei.value) == ["n"]
    assert why in (ei.value.details() or "")


@pytest.mark.fake_step_s(0.02)
async def test_cancel_stops_every_sample(stack: Stack) -> None:
    call = stack.stub.Generate(pb.GenerateRequest(request_id="many", prompt="x", max_tokens=500, n=3, seed=1))
    seen: set[int] = set()
    while len(seen) < 3:
        seen.add((await call.read()).sample)
    await stack.stub.Cancel(pb.CancelRequest(request_id="many"))
    rest = Samples()
    while (m := await call.read()) is not grpc.aio.EOF:
        rest.add(m)
    assert rest.last is not None and rest.last.finish_reason == pb.FINISH_REASON_CANCELLED
    await until(lambda: all(f"many~s{k}" in stack.engine.aborted for k in range(3)), 5, "every sample's abort")


@pytest.mark.fake_step_s(0.02)
async def test_a_deadline_aborts_every_sample(stack: Stack) -> None:
    call = stack.stub.Generate(
        pb.GenerateRequest(request_id="late", prompt="x", max_tokens=500, n=2, seed=1), timeout=0.5
    )
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await Samples.read(call)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: {"late~s0", "late~s1"} <= set(stack.engine.aborted), 5, "every sample's abort")


@pytest.mark.fake_step_s(0.02)
async def test_attach_gives_each_sample_from_its_own_offset(stack: Stack) -> None:
    req = pb.GenerateRequest(prompt="two", max_tokens=40, n=2, seed=5)
    ref = await Samples.read(stack.stub.Generate(req))
    call = stack.stub.Generate(
        pb.GenerateRequest(request_id="two", resumable=True, prompt="two", max_tokens=40, n=2, seed=5)
    )
    have = Samples()
    while len(have.ids[0]) < 3 or len(have.ids[1]) < 5:
        have.add(await call.read())
    call.cancel()  # the caller's connection drops; the samples go on
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await Samples.read(stack.stub.Attach(pb.AttachRequest(request_id="two", offset=3)))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(ei.value) == ["offset"]
    offsets = [len(have.ids[0]), len(have.ids[1])]
    with pytest.raises(grpc.aio.AioRpcError) as ei:  # more samples than the request has
        await Samples.read(stack.stub.Attach(pb.AttachRequest(request_id="two", sample_offsets=[*offsets, 0])))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(ei.value) == ["sample_offsets"]
    rest = await Samples.read(stack.stub.Attach(pb.AttachRequest(request_id="two", sample_offsets=offsets)))
    for k in (0, 1):
        assert rest.idx[k] == list(range(offsets[k], 40))
        assert have.ids[k] + rest.ids[k] == ref.ids[k]  # no gap, no repeat, the same samples
        assert rest.finish[k] == pb.FINISH_REASON_LENGTH
    assert stack.engine.served.count("two~s0") == 1


async def test_a_lost_attempt_resumes_each_unfinished_sample_from_its_own_tokens(stack: Stack) -> None:
    """A hand-driven worker (model "other": no real worker) runs a request of 3 samples. Sample 1
    ends, samples 0 and 2 have tokens; then a gap (Redis lost events) abandons the attempt. The next
    attempt resumes samples 0 and 2 only, each from the tokens the caller has of it; the caller's
    stream goes on with the right indexes and the usage counts every sample once."""
    call = stack.stub.Generate(
        pb.GenerateRequest(request_id="trio", model="other", prompt="x", max_tokens=4, n=3, seed=1), timeout=30
    )
    await call.initial_metadata()
    (lease,) = await stack.queue.lease("gpu", "hand", 1, 1000)
    assert lease.request.sampling.n == 3 and not lease.request.resume_samples
    first = [
        JobEvent(text=" a", token_ids=(1,), index=0, worker="w", sample=0),
        JobEvent(text=" b", token_ids=(2,), index=0, worker="w", sample=1, sample_end=FinishReason.STOP),
        JobEvent(text=" c", token_ids=(3, 4), index=0, worker="w", sample=2),
    ]
    await stack.queue.publish([(lease, e) for e in first], [])
    got = Samples()
    for _ in first:
        got.add(await call.read())
    assert got.finish == {1: pb.FINISH_REASON_STOP}
    await stack.queue.publish([(lease, JobEvent(text=" z", token_ids=(9,), index=5, worker="w", sample=0))], [])
    (lease,) = await stack.queue.lease("gpu", "hand", 1, 1000)  # the gap above: attempt 1
    r = lease.request
    assert r.request_id == "trio~1" and dict(r.resume_samples) == {0: (1,), 2: (3, 4)}
    ending = [
        JobEvent(text=" d", token_ids=(5,), index=0, worker="w", sample=2, sample_end=FinishReason.STOP),
        JobEvent(text=" e", token_ids=(6, 7, 8), index=0, worker="w", sample=0),
    ]
    await stack.queue.publish([(lease, e) for e in ending], [])
    done = JobEvent(index=3, worker="w", sample=0, finished=Finished(FinishReason.LENGTH, Usage(1, 4)))
    await stack.queue.publish([(lease, done)], [])
    while (m := await call.read()) is not grpc.aio.EOF:
        got.add(m)
    assert got.ids == {0: [1, 6, 7, 8], 1: [2], 2: [3, 4, 5]}
    assert got.idx == {0: [0, 1, 2, 3], 1: [0], 2: [0, 1, 2]}
    assert got.finish == {0: pb.FINISH_REASON_LENGTH, 1: pb.FINISH_REASON_STOP, 2: pb.FINISH_REASON_STOP}
    assert got.last is not None and got.last.usage.completion_tokens == 8  # 4 before the gap + 4 after
