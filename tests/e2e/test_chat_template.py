"""A node whose worker renders chats with its own template file (LLAMAMESH_WORKER_CHAT_TEMPLATE), in
the Llama 3.x form with JSON tool calls (tests/data/llama3_json_tools.jinja), over the real
SmolLM2-135M-Instruct: on the CPU, and with vLLM on a GPU (marker gpu). The prompt the engine got is
the template's (its token count, against the same rendering here), and a required or named tool
call always parses, its arguments valid against the tool's schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llamamesh.types import ChatMessage, GenerationRequest
from tests.e2e.conftest import ProcessNode, vllm_node
from tests.e2e.test_http import CHOICES, MODEL, WEATHER_TOOL, assert_a_tool_call, base_url
from tests.redisproc import RedisProcess, free_port
from workers.engines.prompts import render_prompt_ids, use_chat_template

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

LLAMA3 = Path(__file__).parent.parent / "data" / "llama3_json_tools.jinja"
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module", params=["cpu", pytest.param("vllm", marks=pytest.mark.gpu)])
def templated(
    request: pytest.FixtureRequest, e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNode]:
    workdir = tmp_path_factory.mktemp(f"{request.param}-templated")
    env = {"LLAMAMESH_WORKER_CHAT_TEMPLATE": str(LLAMA3), "LLAMAMESH_GATEWAY_HTTP_PORT": str(free_port())}
    if request.param == "cpu":
        env |= {"LLAMAMESH_WORKER_THREADS": "1", "LLAMAMESH_WORKER_MAX_INFLIGHT": "4"}
        node = ProcessNode(workdir, e2e_redis, engine="transformers", extra_env=env)
    else:
        node = vllm_node(workdir, e2e_redis, env)
    try:
        node.start()
        yield node
    finally:
        node.stop()


def client_of(node: ProcessNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(node), api_key="unused", max_retries=0)


def test_the_engine_gets_the_prompt_the_template_renders(templated: ProcessNode) -> None:
    from transformers import AutoTokenizer

    from tests.contract.conftest import smollm2_folder

    tokenizer = use_chat_template(
        AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True), str(LLAMA3)
    )
    tools = [WEATHER_TOOL["function"]]
    expected = render_prompt_ids(
        GenerationRequest(request_id="r", model="m", messages=(ChatMessage("user", ASK),), tools=json.dumps(tools)),
        tokenizer,
    )
    with client_of(templated) as client:
        got = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": ASK}],
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            max_tokens=4,
            temperature=0,
        )
    assert got.usage is not None and got.usage.prompt_tokens == len(expected)


@CHOICES
def test_a_required_or_named_tool_call_always_parses(templated: ProcessNode, choice: object) -> None:
    assert_a_tool_call(base_url(templated), choice)
