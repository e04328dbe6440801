"""GenerationService through the in-process gateway (tests/services/conftest.py): streaming, bad
input, cancellation, deadlines, the queue's states, full pools, retries, resume and re-attach."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import grpc
import pytest
import structlog
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llamamesh.client import error_reason, field_violations
from llamamesh.settings import GatewaySettings
from llamamesh.types import JobEvent
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc as pb_grpc
from tests.services.conftest import Stack
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


async def aborted_and_acked(stack: Stack, rid: str, timeout_s: float = 5.0) -> None:
    """Bounded wait (polling the in-process fakes) for the engine's abort and the job's ack."""
    aborted = lambda: rid in stack.engine.aborted and stack.queue.pending("cpu") == {}  # noqa: E731
    await until(aborted, timeout_s, f"the engine's abort of {rid} and its job's ack")


async def collect(stack: Stack, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [m async for m in stack.stub.Generate(req)]


async def test_generate_streams_to_the_finish(stack: Stack) -> None:
    msgs = await collect(stack, pb.GenerateRequest(request_id="r-1", prompt="hello world", max_tokens=5))
    assert all(m.request_id == "r-1" for m in msgs)
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) == 5
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 5
    assert msgs[-1].usage.prompt_tokens == 2
    assert msgs[-1].timings.total.ToNanoseconds() > 0
    # indexes are contiguous
    idx = 0
    for m in msgs:
        if m.token_ids:
            assert m.index == idx
            idx += len(m.token_ids)
    assert "".join(m.text for m in msgs) == "".join(f" w{t}" for t in ids)
    assert stack.queue.pending("cpu") == {}


async def test_server_makes_a_request_id_and_sends_it_in_headers(stack: Stack) -> None:
    call = stack.stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2))
    md = dict(await call.initial_metadata())
    msgs = [m async for m in call]
    assert md["x-request-id"] == msgs[0].request_id
    assert len(msgs[0].request_id) >= 16


async def test_chat_messages_and_stop_sequence(stack: Stack) -> None:
    first = await collect(
        stack, pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=6, seed=7)
    )
    text = "".join(m.text for m in first)
    stop = text.split()[2]
    second = await collect(
        stack,
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=6, seed=7, stop=[stop]),
    )
    assert second[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert stop not in "".join(m.text for m in second)
    assert text.startswith("".join(m.text for m in second))


BAD = [
    (dict(prompt="x", temperature=-0.1), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-2), "top_k"),
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=-3), "max_tokens"),
    (dict(prompt="x", max_tokens=513), "max_tokens"),
    (dict(prompt="x", messages=[pb.ChatMessage(role="user", content="y")]), "prompt"),
    (dict(), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", stop=["ok", ""]), "stop[1]"),
    (dict(messages=[pb.ChatMessage(role="wizard", content="y")]), "messages[0].role"),
    (dict(prompt="x", min_p=1.5), "min_p"),
    (dict(prompt="x", presence_penalty=3), "presence_penalty"),
    (dict(prompt="x", frequency_penalty=-2.5), "frequency_penalty"),
    (dict(prompt="x", repetition_penalty=0), "repetition_penalty"),
    (dict(prompt="x", logprobs=21), "logprobs"),
    (dict(prompt="x", min_tokens=100, max_tokens=10), "min_tokens"),
    (dict(prompt="x", stop_token_ids=[-1]), "stop_token_ids[0]"),
    (dict(prompt="x", request_id="has space"), "request_id"),
    (dict(prompt="x", temperature=float("nan")), "temperature"),
    (dict(prompt="x", response_format=pb.ResponseFormat(json_object=False)), "response_format.json_object"),
]


@pytest.mark.parametrize(("fields", "field"), BAD)
async def test_bad_input_is_invalid_argument_naming_the_field(stack: Stack, fields: dict, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await collect(stack, pb.GenerateRequest(**fields))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(ei.value)
    assert field in (ei.value.details() or "")
    assert stack.queue.waiting("cpu") == [] and stack.queue.pending("cpu") == {}


async def test_unknown_model_is_not_found(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await collect(stack, pb.GenerateRequest(prompt="x", model="nope"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in (ei.value.details() or "")
    assert error_reason(ei.value) == "MODEL_NOT_FOUND"
    # A name of megabytes is not echoed whole: grpc-core clients refuse a status header past 8 KiB.
    with pytest.raises(grpc.aio.AioRpcError) as long:
        await collect(stack, pb.GenerateRequest(prompt="x", model="m" * 100_000))
    assert long.value.code() == grpc.StatusCode.NOT_FOUND and len(long.value.details() or "") < 200


async def test_engine_rejection_crosses_redis_as_invalid_argument(stack: Stack) -> None:
    words = " ".join(["w"] * 3000)  # the fake engine's context is 2048 "tokens"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await collect(stack, pb.GenerateRequest(prompt=words, max_tokens=4))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(ei.value) == ["prompt"]


@pytest.mark.fake_step_s(0.05)
async def test_client_cancel_aborts_the_job_in_the_engine(stack: Stack) -> None:
    call = stack.stub.Generate(pb.GenerateRequest(request_id="c-1", prompt="long one", max_tokens=500))
    got = 0
    async for m in call:
        got += len(m.token_ids)
        if got >= 3:
            break
    call.cancel()
    await aborted_and_acked(stack, "c-1")
    assert "c-1" in stack.engine.aborted
    assert stack.queue.pending("cpu") == {}
    assert stack.worker.inflight == 0
    last = stack.queue.events_of("c-1")[-1]
    assert last.finished is not None and last.finished.finish_reason.value == "cancelled"


async def test_list_models_and_tokenize(stack: Stack) -> None:
    models = await stack.stub.ListModels(pb.ListModelsRequest())
    assert [(m.id, m.pool, m.default) for m in models.models] == [("tiny", "cpu", True), ("other", "gpu", False)]
    tok = await stack.stub.Tokenize(pb.TokenizeRequest(prompt="a b c"))
    assert tok.count == 3 and len(tok.token_ids) == 3


async def test_queue_down_is_unavailable(stack: Stack) -> None:
    stack.queue.down = True
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await collect(stack, pb.GenerateRequest(prompt="x"))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.fake_step_s(0.05)
async def test_deadline_ends_the_call_and_aborts_the_job(stack: Stack) -> None:
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            [
                m
                async for m in stack.stub.Generate(
                    pb.GenerateRequest(request_id="d-1", prompt="x", max_tokens=500), timeout=0.5
                )
            ]
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The call's own line says so too (not CANCELLED: the caller did not leave); the gateway
        # may end the call after the caller's own clock did.
        await until(lambda: any(e["event"] == "rpc_finished" for e in logs), 5, "the call's rpc_finished line")
    (finished,) = [e for e in logs if e["event"] == "rpc_finished"]
    assert finished["status"] == "DEADLINE_EXCEEDED", finished
    await aborted_and_acked(stack, "d-1")
    assert "d-1" in stack.engine.aborted
    assert stack.queue.pending("cpu") == {}


@pytest.mark.fake_step_s(0.05)
async def test_a_call_cancelled_in_its_deadlines_last_second_ran_out_of_time(stack: Stack) -> None:
    # The caller's deadline fires first and cancels the call; the gateway's, counted from when the call came,
    # is a little later: the call is DEADLINE_EXCEEDED there too, not a caller's cancel.
    with structlog.testing.capture_logs() as logs:
        call = stack.stub.Generate(pb.GenerateRequest(request_id="d-2", prompt="x", max_tokens=500), timeout=1.8)
        await call.read()
        await asyncio.sleep(1.2)  # (standing in for a clock that fires 0.6 s before the gateway's)
        call.cancel()
        await until(lambda: any(e["event"] == "rpc_finished" for e in logs), 5, "the call's rpc_finished line")
    (finished,) = [e for e in logs if e["event"] == "rpc_finished"]
    assert finished["status"] == "DEADLINE_EXCEEDED", finished


async def test_a_stream_read_to_its_last_message_then_dropped_is_a_success(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    backends = stack.gateway.backends
    record = backends.record

    async def slow_record(*args: Any) -> None:  # the gateway's bookkeeping after the last message, on a busy Redis
        await asyncio.sleep(0.5)
        await record(*args)

    monkeypatch.setattr(backends, "record", slow_record)
    with structlog.testing.capture_logs() as logs:
        call = stack.stub.Generate(pb.GenerateRequest(request_id="e-1", prompt="x", max_tokens=4))
        while not (msg := await call.read()).HasField("usage"):
            pass
        call.cancel()  # before the trailers (a client that stops at the last message)
        await until(lambda: any(e["event"] == "rpc_finished" for e in logs), 5, "the call's rpc_finished line")
    (finished,) = [e for e in logs if e["event"] == "rpc_finished"]
    assert finished["status"] == "ok" and msg.finish_reason == pb.FINISH_REASON_LENGTH, finished


@pytest.mark.fake_step_s(0.05)
async def test_cancel_rpc_stops_a_running_request_from_another_connection(stack: Stack) -> None:
    call = stack.stub.Generate(pb.GenerateRequest(prompt="long one", max_tokens=500))
    rid = dict(await call.initial_metadata())["x-request-id"]
    first = await call.read()
    assert first.token_ids
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as other:
        await pb_grpc.GenerationServiceStub(other).Cancel(pb.CancelRequest(request_id=rid))
    rest = []
    while (m := await call.read()) is not grpc.aio.EOF:  # the stream ends, not with an error
        rest.append(m)
    assert rest[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    await aborted_and_acked(stack, rid)
    assert rid in stack.engine.aborted and stack.worker.inflight == 0
    await stack.stub.Cancel(pb.CancelRequest(request_id=rid))  # again, or for a finished id: no error
    await stack.stub.Cancel(pb.CancelRequest(request_id="never-seen"))


@pytest.mark.parametrize("rid", ["", "a b", "x" * 129])
async def test_cancel_rpc_names_a_bad_request_id(stack: Stack, rid: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stack.stub.Cancel(pb.CancelRequest(request_id=rid))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(ei.value) == ["request_id"]


async def test_a_full_pool_is_resource_exhausted_with_retry_info(stack: Stack) -> None:
    """Pool gpu (model "other") has no worker: its requests wait. Past max_queue, refused at once."""
    settings = GatewaySettings(port=0, models="tiny=cpu,other=gpu", max_queue=2, retry_after_s=2.5)
    async with stack.beside(settings) as stub:
        waiting = [stub.Generate(pb.GenerateRequest(model="other", prompt=f"w{i}")) for i in range(2)]
        for w in waiting:
            await w.initial_metadata()  # accepted and queued
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Generate(pb.GenerateRequest(model="other", prompt="one too many")).read()
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(ei.value)
        assert status is not None
        retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
        info = error_details_pb2.RetryInfo()
        retry[0].Unpack(info)
        assert info.retry_delay.seconds == 2 and info.retry_delay.nanos == 500_000_000
        assert len(stack.queue.waiting("gpu")) == 2  # nothing more was queued
        for w in waiting:
            w.cancel()


async def test_a_pool_without_workers_is_unavailable_soon_not_at_the_deadline(stack: Stack) -> None:
    settings = GatewaySettings(port=0, models="tiny=cpu,other=gpu", no_worker_wait_s=0.5)
    async with stack.beside(settings) as stub:
        t0 = time.monotonic()
        call = stub.Generate(pb.GenerateRequest(request_id="lonely", model="other", prompt="x"), timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call.read()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "no live worker" in (ei.value.details() or "")
        assert time.monotonic() - t0 < 5  # one liveness check after the wait, far before the deadline

        # A worker that comes later never runs it: the gateway cancelled the job right after the status
        # went out, or (the pool already empty for longer than the wait when it came) never queued it.
        async def called_off() -> bool:
            return stack.queue.is_cancelled("lonely") or not await stack.queue.attempts("lonely")

        await until(called_off, 5, "the gateway to cancel the job, or not to have queued it")
        t1 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await stub.Generate(pb.GenerateRequest(model="other", prompt="y"), timeout=60).read()
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t1 < 1  # at once


async def test_tokenize_for_a_pool_without_workers_is_unavailable_soon_not_at_the_deadline(stack: Stack) -> None:
    settings = GatewaySettings(port=0, models="tiny=cpu,other=gpu", no_worker_wait_s=0.5)
    async with stack.beside(settings) as stub:
        for _ in range(2):  # waiting out the wait; then, the pool empty for longer, at once
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Tokenize(pb.TokenizeRequest(model="other", prompt="x"), timeout=60)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "no live worker" in (ei.value.details() or "")
            assert time.monotonic() - t0 < 5
        assert (await stub.Tokenize(pb.TokenizeRequest(model="tiny", prompt="a b"), timeout=10)).count == 2


@pytest.mark.fake_step_s(0.05)
async def test_a_deadline_shorter_than_the_queue_wait_is_refused_at_once(stack: Stack) -> None:
    """While every slot of the pool is taken, a job waits and the pool's recent requests waited 5 s, a
    1-s deadline is refused at once; once a slot is free it is served, whatever the last waits were."""
    pool = stack.gateway.backends.pools["cpu"]
    busy = [stack.stub.Generate(pb.GenerateRequest(prompt="long one", max_tokens=500)) for _ in range(9)]
    await until(lambda: not pool.has_room(), 10, "the gateway to see every slot taken and a job waiting")
    for _ in range(5):  # the pool's recent requests waited 5 s before a worker took them
        stack.gateway.backends.observe_queue_wait("cpu", 5.0)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await collect_with_timeout(stack, pb.GenerateRequest(prompt="x"), 1.0)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "queue wait" in (ei.value.details() or "")
    assert time.monotonic() - t0 < 0.5  # at once, not queued:
    running = [x.request for x in stack.worker.jobs.running.values()]
    assert all(r.prompt == "long one" for r in [*stack.queue.waiting("cpu"), *running])
    assert pool.breaker.state.value == "closed"  # not the backend's fault
    for call in busy:
        call.cancel()
    await until(pool.has_room, 10, "the gateway to see a free slot")
    assert (await collect_with_timeout(stack, pb.GenerateRequest(prompt="x", max_tokens=2), 1.0))[-1].finish_reason


async def collect_with_timeout(stack: Stack, req: pb.GenerateRequest, timeout: float) -> list[pb.GenerateResponse]:
    return [m async for m in stack.stub.Generate(req, timeout=timeout)]


@pytest.mark.fake_step_s(0.05)
async def test_redis_back_without_its_data_ends_open_streams_and_holds_readiness(stack: Stack) -> None:
    call = stack.stub.Generate(pb.GenerateRequest(prompt="long one", max_tokens=500))
    assert (await call.read()).token_ids
    stack.queue.lose_data()  # what a restart without persistence looks like
    # Queued to the data Redis holds now, before the gateway saw what happened: not lost.
    since = stack.stub.Generate(pb.GenerateRequest(prompt="since", max_tokens=20))
    assert (await since.read()).token_ids
    await stack.gateway.health.check_now()
    assert stack.gateway.health.data_losses == 1
    health = health_pb2_grpc.HealthStub(stack.channel)
    got = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING  # not run against silently
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await asyncio.wait_for(_drain(call), 5)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "without its data" in (ei.value.details() or "")
    last = pb.GenerateResponse()
    while (m := await since.read()) is not grpc.aio.EOF:
        last = m
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 20


async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


async def _tokens(stream: object) -> tuple[list[int], list[int], int]:
    """(token ids, their indexes, the finish reason) of a response stream read to its end."""
    ids: list[int] = []
    idx: list[int] = []
    finish = 0
    async for m in stream:  # type: ignore[attr-defined]
        ids += m.token_ids
        idx += range(m.index, m.index + len(m.token_ids))
        finish = m.finish_reason or finish
    return ids, idx, finish


@pytest.mark.fake_step_s(0.02)
async def test_a_resumable_stream_reattached_from_an_offset_gets_exactly_the_rest(stack: Stack) -> None:
    ref, _, _ = await _tokens(stack.stub.Generate(pb.GenerateRequest(prompt="same words", max_tokens=60)))
    call = stack.stub.Generate(pb.GenerateRequest(request_id="r1", prompt="same words", max_tokens=60, resumable=True))
    got: list[int] = []
    while len(got) < 10:
        got += (await call.read()).token_ids
    call.cancel()  # the connection drops; the generation goes on
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.gateway.port}") as other:  # any gateway
        rest, idx, finish = await _tokens(
            pb_grpc.GenerationServiceStub(other).Attach(pb.AttachRequest(request_id="r1", offset=len(got)))
        )
    assert idx == list(range(len(got), 60)) and finish == pb.FINISH_REASON_LENGTH
    assert got + rest == ref  # no gap, no duplicate, the same generation
    assert stack.engine.served.count("r1") == 1  # one job, run to its end (finish LENGTH above)


async def test_a_retried_request_id_is_one_job(stack: Stack) -> None:
    req = pb.GenerateRequest(request_id="dup", prompt="once only", max_tokens=20)
    (a, _, fa), (b, _, fb) = await asyncio.gather(_tokens(stack.stub.Generate(req)), _tokens(stack.stub.Generate(req)))
    assert a == b and len(a) == 20 and fa == fb == pb.FINISH_REASON_LENGTH
    assert stack.engine.served.count("dup") == 1


@pytest.mark.fake_step_s(0.05)
async def test_a_detached_stream_is_cancelled_after_the_grace_unless_reattached(stack: Stack) -> None:
    settings = GatewaySettings(port=0, models="tiny=cpu", reattach_grace_s=0.3)
    async with stack.beside(settings) as stub:
        call = stub.Generate(pb.GenerateRequest(request_id="gone", prompt="x", max_tokens=500, resumable=True))
        assert (await call.read()).token_ids
        call.cancel()
        await aborted_and_acked(stack, "gone")  # nobody came back within 0.3 s
        ids, _, finish = await _tokens(stub.Attach(pb.AttachRequest(request_id="gone")))
        assert finish == pb.FINISH_REASON_CANCELLED and 0 < len(ids) < 500  # what it had, then its end


async def test_attach_to_an_unknown_or_malformed_id(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await _tokens(stack.stub.Attach(pb.AttachRequest(request_id="never-seen")))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await _tokens(stack.stub.Attach(pb.AttachRequest(request_id="a b")))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(bad.value) == ["request_id"]


async def test_cancel_rpc_ends_a_queued_request_at_once(stack: Stack) -> None:
    """Model "other" (pool gpu) has no worker: its request waits in the queue. Cancel ends its
    stream now, not when some worker reaches the job."""
    call = stack.stub.Generate(pb.GenerateRequest(request_id="queued", model="other", prompt="x"), timeout=30)
    await call.initial_metadata()
    t0 = time.monotonic()
    await stack.stub.Cancel(pb.CancelRequest(request_id="queued"))
    msgs = await asyncio.wait_for(_drain_msgs(call), 5)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_CANCELLED and time.monotonic() - t0 < 2
    leased = await stack.queue.lease("gpu", "a-worker-that-comes-later", 10, 100)
    assert [(x.request.request_id, x.cancelled) for x in leased] == [("queued", True)]  # it skips it


async def _drain_msgs(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


async def test_a_gap_in_a_streams_tokens_resumes_it_and_never_passes_silently(stack: Stack) -> None:
    """What Redis with appendfsync everysec can do after a crash: events are gone. The attempt is
    abandoned and the request resumed from what the caller has (the caller never gets a silent
    gap); with no attempt left the stream ends UNAVAILABLE naming the lost tokens."""
    call = stack.stub.Generate(
        pb.GenerateRequest(request_id="gappy", model="other", prompt="x", max_tokens=8), timeout=30
    )
    await call.initial_metadata()
    (lease,) = await stack.queue.lease("gpu", "a-hand-driven-worker", 1, 1000)
    await stack.queue.publish([(lease, JobEvent(text=" a", token_ids=(1,), index=0, worker="w"))], [])
    first = await call.read()
    assert first.token_ids == [1]
    got = [first]
    for n, sent in ((1, (1,)), (2, (1, 2))):
        await stack.queue.publish([(lease, JobEvent(text=" d", token_ids=(4,), index=3, worker="w"))], [])  # lost
        (lease,) = await stack.queue.lease("gpu", "a-hand-driven-worker", 1, 1000)
        assert lease.request.request_id == f"gappy~{n}" and lease.request.resume_token_ids == sent
        assert lease.request.sampling.max_tokens == 8 - len(sent)
        await stack.queue.publish([(lease, JobEvent(text=" b", token_ids=(n + 1,), index=0, worker="w"))], [])
        got.append(await call.read())
    assert [(m.index, list(m.token_ids)) for m in got] == [(0, [1]), (1, [2]), (2, [3])]  # one unbroken stream
    await stack.queue.publish([(lease, JobEvent(text=" d", token_ids=(9,), index=4, worker="w"))], [])  # its 1..3 lost
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call.read()
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "lost tokens 3..5" in (ei.value.details() or "")


_STREAMING_CLIENT = """
import asyncio, sys, grpc
from llamamesh.v1 import generation_pb2 as pb, generation_pb2_grpc
async def main():
    stub = generation_pb2_grpc.GenerationServiceStub(grpc.aio.insecure_channel(sys.argv[1]))
    calls = [stub.Generate(pb.GenerateRequest(request_id=f"gone-{i}", prompt=f"x {i}", max_tokens=500))
             for i in range(7)]
    for c in calls:
        await c.read()
    print("streaming", flush=True)
    await asyncio.sleep(60)  # streaming until the test kills this process
asyncio.run(main())
"""


@pytest.mark.fake_step_s(0.001)
async def test_a_client_process_killed_mid_stream_ends_each_call_cancelled_at_once(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's process dies while the gateway writes tokens at full speed: each call's write
    fails, and its handler is closed in its own task right then (the job aborted in the engine,
    one rpc_finished CANCELLED line), not later by the garbage collector in another task, whose
    clean-up failed resetting the call's context variables (logged as errors)."""
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STREAMING_CLIENT, f"127.0.0.1:{stack.gateway.port}", stdout=asyncio.subprocess.PIPE
    )
    assert client.stdout is not None
    with structlog.testing.capture_logs() as logs:
        assert await asyncio.wait_for(client.stdout.readline(), 20) == b"streaming\n"
        client.kill()
        await client.wait()
        for i in range(7):
            await aborted_and_acked(stack, f"gone-{i}")
    finished = [e for e in logs if e["event"] == "rpc_finished" and e["method"] == "Generate"]
    assert sorted(e["status"] for e in finished) == ["CANCELLED"] * 7, finished
    assert [e for e in logs if e.get("log_level") == "error"] == []
    # asyncio's "Task exception was never retrieved", OpenTelemetry's "Failed to detach context"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert stack.worker.inflight == 0
