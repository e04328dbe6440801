"""Tool calling through both doors: an in-process gateway and a fake-engine worker whose output is
scripted (``__say__``), so that what the gateway makes of an output is checked exactly: calls in the
Llama 3.x JSON form become tool calls (gRPC's ToolCall, OpenAI's tool_calls, whole and streamed),
anything else stays text; and the requests' tools are validated before anything is queued."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from llamamesh.client import field_violations
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from services.tools import Tools, read_calls
from tests.services.conftest import Stack

pytestmark = pytest.mark.timeout(60)

WEATHER = pb.Tool(
    name="get_weather",
    description="The weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
TIME = pb.Tool(name="get_time", parameters=json.dumps({"type": "object", "properties": {}}))
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def asked(say: str, **fields: object) -> pb.GenerateRequest:
    fields = {"max_tokens": 64, **fields}
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=f"__say__ {say}")], tools=[WEATHER, TIME], **fields
    )


async def grpc_answer(stack: Stack, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [m async for m in stack.stub.Generate(req)]


@pytest.mark.parametrize(
    ("said", "names"),
    [
        (CALL, ["get_weather"]),
        (f"<|python_tag|>{CALL}", ["get_weather"]),
        (f'[{CALL}, {{"name": "get_time", "parameters": {{}}}}]', ["get_weather", "get_time"]),
        (f'{CALL}; {{"name": "get_time", "arguments": {{}}}}', ["get_weather", "get_time"]),
    ],
)
async def test_calls_in_the_llama_json_form_become_tool_calls(
    openai_door: tuple[Stack, openai.AsyncOpenAI], said: str, names: list[str]
) -> None:
    got = await grpc_answer(openai_door[0], asked(said))
    last = got[-1]
    assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS and not "".join(m.text for m in got)
    assert [c.name for c in last.tool_calls] == names and all(c.id.startswith("call_") for c in last.tool_calls)
    assert json.loads(last.tool_calls[0].arguments) == {"city": "Paris"}
    ids = [t for m in got for t in m.token_ids]
    assert len(ids) == last.usage.completion_tokens  # every token still delivered, once


@pytest.mark.parametrize(
    "said",
    [
        "It is sunny in Paris.",  # text
        '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
        '{"name": "launch_rockets", "parameters": {}}',  # not one of the tools
        '{"answer": 42}',  # JSON, not a call
        '{"name": ["get_weather"], "parameters": {}}',  # a name that is not a string
        '{"name": "get_weather", "parameters": [1]}',  # arguments that are not an object
    ],
)
async def test_anything_else_is_the_answers_text(openai_door: tuple[Stack, openai.AsyncOpenAI], said: str) -> None:
    got = await grpc_answer(openai_door[0], asked(said))
    assert "".join(m.text for m in got) == said
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP and not got[-1].tool_calls


async def test_a_call_cut_short_by_max_tokens_is_text_that_ends_length(
    openai_door: tuple[Stack, openai.AsyncOpenAI],
) -> None:
    got = await grpc_answer(openai_door[0], asked(CALL, max_tokens=3))  # (the fake says 4 characters a token)
    assert "".join(m.text for m in got) == CALL[:12]
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH and not got[-1].tool_calls
    _, client = openai_door
    chat = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"__say__ {CALL}"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        max_tokens=3,
    )
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content == CALL[:12]
    assert not chat.choices[0].message.tool_calls


def test_the_hermes_form_is_read_when_the_gateway_is_set_for_it() -> None:
    names = frozenset({"get_weather", "get_time"})
    hermes = Tools(names, parser="hermes")
    first = CALL.replace("parameters", "arguments")
    two = f'<tool_call>\n{first}\n</tool_call>\n<tool_call>{{"name": "get_time"}}</tool_call>'
    calls = read_calls(two, hermes)
    assert calls is not None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert read_calls(CALL, hermes) is not None  # the bare form constrained decoding makes
    for not_calls in ('<tool_call>{"name": "get_time"}', f"<tool_call>{CALL}</tool_call> and some words"):
        assert read_calls(not_calls, hermes) is None
    assert read_calls(two, Tools(names)) is None  # the Llama form does not read tags


async def test_one_call_only_when_parallel_calls_are_off_and_none_when_the_choice_is_none() -> None:
    two = f'[{CALL}, {{"name": "get_time", "parameters": {{}}}}]'
    names = frozenset({"get_weather", "get_time"})
    assert read_calls(two, Tools(names, parallel=False)) is None
    assert read_calls(two, Tools(names)) is not None
    assert not Tools(names, mode="none").reads_calls


async def test_the_sdk_sees_tool_calls_whole_and_streamed(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    _, client = openai_door
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": json.loads(WEATHER.parameters)}},
    ]
    messages = [{"role": "user", "content": f"__say__ {CALL}"}]
    got = await client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=64)  # type: ignore[arg-type]
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        max_tokens=64,
        stream=True,
    )
    deltas = [c.choices[0] async for c in stream if c.choices]
    calls = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [(t.index, t.function.name if t.function else None) for t in calls] == [(0, "get_weather")]
    assert deltas[-1].finish_reason == "tool_calls" and not deltas[-1].delta.tool_calls  # a chunk of its own
    assert deltas[-2].finish_reason is None  # (the calls' chunk), as OpenAI streams them
    strict = [
        {"type": "function", "function": {**tools[0]["function"], "strict": True}}
    ]  # (the helper parses only those)
    async with client.chat.completions.stream(model="tiny", messages=messages, tools=strict, max_tokens=64) as helper:  # type: ignore[arg-type]
        kinds = [e.type async for e in helper]
    assert "tool_calls.function.arguments.done" in kinds, kinds  # the SDK's helper says the call is whole
    # the conversation goes on with the call and its answer in the history
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
        {"role": "user", "content": "__say__ Clear skies in Paris."},
    ]
    answer = await client.chat.completions.create(model="tiny", messages=history, tools=tools, max_tokens=64)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "Clear skies in Paris." and not answer.choices[0].message.tool_calls


async def test_bad_tools_are_invalid_argument_naming_the_field(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    stack, client = openai_door
    cases = [
        (asked("x", tool_choice=pb.ToolChoice(function="nope")), "tool_choice.function"),
        (asked("x", tool_choice=pb.ToolChoice(mode="sometimes")), "tool_choice.mode"),
        (pb.GenerateRequest(prompt="x", tool_choice=pb.ToolChoice(mode="sometimes")), "tool_choice.mode"),
        (pb.GenerateRequest(prompt="x", tool_choice=pb.ToolChoice(mode="required")), "tool_choice.mode"),
        (pb.GenerateRequest(prompt="x", tool_choice=pb.ToolChoice(function="f")), "tool_choice.function"),
        (pb.GenerateRequest(prompt="x", tools=[WEATHER]), "tools"),
        (
            pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="x")], tools=[WEATHER, WEATHER]),
            "tools[1].name",
        ),
        (
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool(name="f", parameters="[")]
            ),
            "tools[0].parameters",
        ),
        (  # nested deeper than a schema may be
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="x")],
                tools=[pb.Tool(name="f", parameters='{"type": "object", "a": ' + "[" * 70 + "]" * 70 + "}")],
            ),
            "tools[0].parameters",
        ),
        (
            asked("x", response_format=pb.ResponseFormat(json_schema='{"a": ' * 900 + "1" + "}" * 900)),
            "response_format.json_schema",
        ),
        (  # a keyword the grammar would drop: refused, not answered unchecked
            pb.GenerateRequest(
                prompt="x", response_format=pb.ResponseFormat(json_schema='{"type": "array", "uniqueItems": true}')
            ),
            "response_format.json_schema",
        ),
        (  # the same in a tool whose call is forced
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="x")],
                tools=[pb.Tool(name="f", parameters='{"type": "object", "not": {"required": ["a"]}}')],
                tool_choice=pb.ToolChoice(mode="required"),
            ),
            "tools[0].parameters",
        ),
        (
            asked("x", tool_choice=pb.ToolChoice(mode="required"), response_format=pb.ResponseFormat(json_object=True)),
            "tool_choice",
        ),
        (
            pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(name="f", arguments="{}")])]
            ),
            "messages[0].tool_calls",
        ),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="tool", content="42")]), "messages[0].tool_call_id"),
    ]
    for req, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await grpc_answer(stack, req)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in field_violations(exc.value), (
            field,
            exc.value.details(),
        )
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert bad.value.param == "tool_choice.function.name"  # as OpenAI's request names it
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "a b"}}],
        )
    assert bad.value.param == "tools[0].function.name", bad.value.body
    for choice in ("required", "auto"):  # a type JSON Schema does not have, whether its call is forced or not
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "a", "parameters": {"properties": {"x": {"type": "foo"}}}},
                    }
                ],
                tool_choice=choice,  # type: ignore[arg-type]
            )
        assert bad.value.param == "tools[0].function.parameters" and "'foo'" in bad.value.message, bad.value.body
    called = {
        "role": "assistant",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{no"}}],
    }
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}, called])  # type: ignore[list-item]
    assert bad.value.param == "messages[1].tool_calls[0].function.arguments", bad.value.body
    with pytest.raises(openai.BadRequestError) as bad:  # required, but nothing to call
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], tool_choice="required"
        )
    assert bad.value.param == "tool_choice"
    batches = batch_pb2_grpc.BatchServiceStub(stack.channel)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await batches.BatchGenerate(bpb.BatchGenerateRequest(items=[bpb.BatchItem(custom_id="a", request=asked("x"))]))
    assert "items[0].request.tools" in field_violations(exc.value)
