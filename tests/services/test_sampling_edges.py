"""Property, through the whole in-process path (gRPC gateway, queue, a real Worker, the engine): any
sampling values a caller sends end OK or INVALID_ARGUMENT naming the fields (never INTERNAL, never
UNAVAILABLE), a greedy request sent at the same time gets exactly its tokens, and the worker keeps
serving. With the fake engine (many examples) and the real CPU engine."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamamesh.client import field_violations
from llamamesh.settings import GatewaySettings, WorkerSettings
from llamamesh.v1 import generation_pb2 as pb
from tests.sampling_strategies import sampling_fields
from tests.services.conftest import Config, Stack, running
from workers.engines.base import Engine

pytestmark = pytest.mark.timeout(300)

# Field names a BadRequest may name: the request's own, with an index for repeated ones.
NAMED = re.compile(
    r"^(max_tokens|temperature|top_p|top_k|min_p|presence_penalty|frequency_penalty|"
    r"repetition_penalty|seed|min_tokens|logprobs|"
    r"stop(\[\d+\])?|stop_token_ids(\[\d+\])?)$"
)
CANARY = pb.GenerateRequest(prompt="Name three colours.", max_tokens=4, temperature=0.0, ignore_eos=True)


@dataclass
class Path:
    loop: asyncio.AbstractEventLoop
    stack: Stack
    reference: list[int]  # the canary's tokens, alone


def path(engine: Callable[[WorkerSettings], Engine], ws: WorkerSettings) -> Iterator[Path]:
    """The stack of one worker of ``ws`` on its own event loop (the property tests are synchronous)."""
    loop = asyncio.new_event_loop()
    exits = contextlib.AsyncExitStack()
    gateway = GatewaySettings(port=0, max_tokens_cap=8, default_max_tokens=4, models=f"m={ws.pool}")
    config = Config(gateway=gateway, workers=(ws,), engine=engine, ready_s=120)

    async def up() -> Path:
        stack = await exits.enter_async_context(running(config))
        reference = [t async for m in stack.stub.Generate(CANARY) for t in m.token_ids]
        return Path(loop, stack, reference)

    p = loop.run_until_complete(up())
    try:
        yield p
    finally:
        loop.run_until_complete(exits.aclose())
        loop.close()


@pytest.fixture(scope="module")
def fake_path() -> Iterator[Path]:
    from workers.engines.fake import FakeEngine

    yield from path(FakeEngine, WorkerSettings(pool="cpu", engine="fake", max_inflight=8))


@pytest.fixture(scope="module")
def cpu_path() -> Iterator[Path]:
    from workers.engines.transformers import TransformersEngine

    yield from path(TransformersEngine, WorkerSettings(pool="cpu", max_inflight=4, max_model_len=256, threads=1))


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
                return [m async for m in p.stack.stub.Generate(req, timeout=60)], None
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
    assert p.stack.worker.engine_died is None and not p.stack.running.tasks[0].done()


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


def test_a_temperature_of_1e_40_is_served_greedy(cpu_path: Path) -> None:
    """{"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"temperature":1e-40}: greedy."""

    async def both() -> list[list[int]]:
        msgs = [pb.ChatMessage(role="user", content="Hi")]
        out = []
        for t in (1e-40, 0.0):
            req = pb.GenerateRequest(messages=msgs, max_tokens=8, temperature=t)
            out.append([tok async for m in cpu_path.stack.stub.Generate(req) for tok in m.token_ids])
        return out

    tiny, greedy = cpu_path.loop.run_until_complete(both())
    assert tiny == greedy and tiny
