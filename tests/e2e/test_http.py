"""The OpenAI-compatible HTTP door of a real node (a gateway process, a worker with the real
SmolLM2-135M-Instruct): the official ``openai`` SDK, sync and async, and ``curl -N`` for raw
server-sent events. Greedy answers through the HTTP door equal those through gRPC: one relay."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from llamamesh.client import Client
from tests.e2e.conftest import ProcessNode
from tests.e2e.test_batch import ENV as BATCH_ENV
from tests.redisproc import RedisProcess, free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name three colours."}]


def base_url(node: ProcessNode) -> str:
    return f"http://127.0.0.1:{node.env['LLAMAMESH_GATEWAY_HTTP_PORT']}/v1"


async def test_the_sdk_streams_the_same_greedy_answer_as_grpc(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        grpc_text = await c.complete(messages=[("user", ASK[0]["content"])], max_tokens=24, temperature=0.0)
    async with openai.AsyncOpenAI(base_url=base_url(node), api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == grpc_text and text.strip()
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens > 5


def test_the_sync_sdk_completes_a_prompt_and_lists_the_model(node: ProcessNode) -> None:
    with openai.OpenAI(base_url=base_url(node), api_key="unused", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        got = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert got.choices[0].text.strip() and got.usage is not None and got.usage.completion_tokens <= 6


async def test_curl_reads_the_raw_event_stream(node: ProcessNode) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": MODEL, "messages": ASK, "max_tokens": 8, "stream": True})
    done = await asyncio.to_thread(
        subprocess.run,
        [curl, "-sS", "-N", f"{base_url(node)}/chat/completions", "-H", "content-type: application/json", "-d", body],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture
def batch_node(e2e_redis: RedisProcess, tmp_path: Path) -> Iterator[ProcessNode]:
    """A node with its HTTP door and two workers of the real model; items of a dead worker are taken
    over after 3 s."""
    env = {**BATCH_ENV, "LLAMAMESH_GATEWAY_HTTP_PORT": str(free_port())}
    n = ProcessNode(tmp_path, e2e_redis, engine="transformers", extra_env=env)
    try:
        n.start()
        n.spawn("worker2", "workers", LLAMAMESH_WORKER_CONSUMER="e2e-worker-2")
        yield n
    finally:
        n.stop()


def test_an_openai_batch_file_runs_to_its_output_file_through_a_worker_kill(batch_node: ProcessNode) -> None:
    """The SDK uploads a JSONL file, creates a batch, and reads the output file: every line once,
    though the worker running the first items was killed (kill -9) mid-batch."""
    lines = [
        {
            "custom_id": f"doc-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 12},
        }
        for i in range(12)
    ]
    content = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    with openai.OpenAI(base_url=base_url(batch_node), api_key="unused", max_retries=0) as client:
        uploaded = client.files.create(file=("docs.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(
            lambda: client.batches.retrieve(batch.id).request_counts,
            120,
            "a first result",
            done=lambda c: c is not None and c.completed >= 1,
            poll_s=0.2,
        )
        batch_node.procs["worker"].send_signal(signal.SIGKILL)  # its running items stay leased to it
        batch_node.procs["worker"].wait(10)
        done = wait_until(
            lambda: client.batches.retrieve(batch.id),
            240,
            "the batch to complete",
            done=lambda b: b.status == "completed",
            poll_s=0.5,
        )
        assert done.output_file_id is not None and done.request_counts is not None
        assert done.request_counts.completed == 12 and done.error_file_id is None
        output = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines)  # each once
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] for x in output)
    assert done.usage is not None and done.usage.output_tokens == sum(
        x["response"]["body"]["usage"]["completion_tokens"] for x in output
    )


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


# tool_choice: a named function, or any of them
CHOICES = pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"]
)


def assert_a_tool_call(base: str, choice: object) -> None:
    """A chat asking for the weather with ``choice``: the answer is one call to the tools (the named
    one when named), its arguments valid against that tool's schema."""
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        got = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=96,
            temperature=0,
        )
    answer = got.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    (call,) = answer.message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")
    if choice != "required":
        assert call.function.name == "get_weather"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


@CHOICES
def test_a_required_or_named_tool_call_always_parses_on_the_real_model(node: ProcessNode, choice: object) -> None:
    """Constrained decoding makes the answer a call to the tools, with arguments their schema
    accepts: the model's chat template got the tools, the engine the call's grammar."""
    assert_a_tool_call(base_url(node), choice)
