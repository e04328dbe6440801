"""Property, through the whole in-process path (gRPC gateway, queue, a real Worker, the engine): any
sampling values a caller sends end OK or INVALID_ARGUMENT naming the fields (never INTERNAL, never
UNAVAILABLE), a greedy request sent at the same time gets exactly its tokens, and the worker keeps
serving. With the fake engine (many examples) and the real CPU engine."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamamesh.client import field_violations
from llamamesh.queue.memory import MemoryQueue
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from services.server import Gateway, start_gateway
from tests.sampling_strategies import sampling_fields
from workers.engines.base import Engine
from workers.worker import Worker

pytestmark = pytest.mark.timeout(300)

# Field names a BadRequest may name: the request's own, with an index for repeated ones.
NAMED = re.compile(r"^(max_tokens|temperature|top_p|top_k|min_p|presence_penalty|frequency_penalty|"
                   r"repetition_penalty|seed|min_tokens|logprobs|"
                   r"stop(\[\d+\])?|stop_token_ids(\[\d+\])?)$")  # fmt: skip
CANARY = pb.GenerateRequest(prompt="Name three colours.", max_tokens=4, temperature=0.0, ignore_eos=True)


@dataclass
class Path:
    loop: asyncio.AbstractEventLoop
    gateway: Gateway
    worker: Worker
    task: asyncio.Task[None]
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationServiceStub
    reference: list[int]


def path(engine: Engine, ws: WorkerSettings) -> Iterator[Path]:
    loop = asyncio.new_event_loop()

    async def up() -> Path:
        queue = MemoryQueue()
        gateway = await start_gateway(queue, GatewaySettings(port=0, max_tokens_cap=8, default_max_tokens=4,
                                                             models=f"m={ws.pool}"), port=0)  # fmt: skip
        worker = Worker(ws, queue, engine, block_ms=100)
        task = asyncio.create_task(worker.run(asyncio.Event()))
        await asyncio.wait_for(worker.ready.wait(), 120)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        reference = [t async for m in stub.Generate(CANARY) for t in m.token_ids]
        return Path(loop, gateway, worker, task, channel, stub, reference)

    p = loop.run_until_complete(up())
    try:
        yield p
    finally:

        async def down() -> None:
            await p.channel.close()
            p.task.cancel()
            with contextlib.suppress(BaseException):
                await p.task
            await p.gateway.stop(0)
            await engine.shutdown()

        loop.run_until_complete(down())
        loop.close()


@pytest.fixture(scope="module")
def fake_path() -> Iterator[Path]:
    from workers.engines.fake import FakeEngine

    ws = WorkerSettings(pool="cpu", engine="fake", max_inflight=8)
    yield from path(FakeEngine(ws), ws)


@pytest.fixture(scope="module")
def cpu_path() -> Iterator[Path]:
    from workers.engines.transformers import TransformersEngine

    ws = WorkerSettings(pool="cpu", max_inflight=4, max_model_len=256, threads=1)
    yield from path(TransformersEngine(ws), ws)


def generate_request(fields: dict[str, object]) -> pb.GenerateRequest:
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(req, name).extend(value)
        else:
            setattr(req, name, value)  # float32 fields keep the float32 value
    return req


def check(p: Path, fields: dict[str, object]) -> None:
    async def both() -> tuple[tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None], ...]:
        async def call(req: pb.GenerateRequest) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None]:
            try:
                return [m async for m in p.stub.Generate(req, timeout=60)], None
            except grpc.aio.AioRpcError as err:
                return [], err

        return tuple(await asyncio.gather(call(generate_request(fields)), call(CANARY)))

    (odd, err), (canary, canary_err) = p.loop.run_until_complete(both())
    assert canary_err is None, canary_err
    assert [t for m in canary for t in m.token_ids] == p.reference
    if err is not None:
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), fields)
        named = field_violations(err)
        assert named and all(NAMED.match(f) for f in named), named
    else:
        assert odd[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED and len([t for m in odd for t in m.token_ids]) <= 8
    assert p.worker.engine_died is None and not p.task.done()


def proto_fields() -> st.SearchStrategy[dict[str, object]]:
    """The strategy's fields as the proto takes them: int32/int64 ranges, lists for repeated fields."""
    def fit(fields: dict[str, object]) -> dict[str, object]:
        return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in fields.items()}

    return sampling_fields(st.integers(-(2**31), 2**31 - 1)).map(fit)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=proto_fields())
def test_any_sampling_values_through_the_gateway_and_fake_engine(fake_path: Path, fields: dict[str, object]) -> None:
    check(fake_path, fields)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=proto_fields())
def test_any_sampling_values_through_the_gateway_and_cpu_engine(cpu_path: Path, fields: dict[str, object]) -> None:
    check(cpu_path, fields)


def test_the_issues_request_is_served_greedy(cpu_path: Path) -> None:
    """{"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"temperature":1e-40}: greedy."""
    async def both() -> list[list[int]]:
        msgs = [pb.ChatMessage(role="user", content="Hi")]
        out = []
        for t in (1e-40, 0.0):
            req = pb.GenerateRequest(messages=msgs, max_tokens=8, temperature=t)
            out.append([tok async for m in cpu_path.stub.Generate(req) for tok in m.token_ids])
        return out

    tiny, greedy = cpu_path.loop.run_until_complete(both())
    assert tiny == greedy and tiny
