"""The tools and tool turns of a chat as the chat template gets them (workers/engines/prompts.py):
a template that renders tools gets them as its ``tools`` argument; one that does not gets them as
a system turn in Llama 3.1's JSON-call form; calls and tool answers in the history in Hugging Face's
form. With the real SmolLM2 tokenizer, whose template has no tools, the tools reach the prompt."""

from __future__ import annotations

import json

from llamamesh.types import ChatMessage, GenerationRequest
from workers.engines.prompts import TOOLS_TURN, chat_turns

TOOLS = json.dumps([{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}])
CALLS = json.dumps([{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}])


def request(*messages: ChatMessage, tools: str = TOOLS) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", messages=messages, tools=tools)


def test_a_template_that_renders_tools_gets_them_as_its_argument() -> None:
    chat, extra = chat_turns(request(ChatMessage("user", "hi")), "{% for t in tools %}{{ t }}{% endfor %}")
    assert chat == [{"role": "user", "content": "hi"}]
    assert extra == {"tools": [{"type": "function", "function": json.loads(TOOLS)[0]}]}


def test_a_template_without_tools_gets_them_as_a_system_turn_after_the_callers() -> None:
    chat, extra = chat_turns(request(ChatMessage("system", "Be brief."), ChatMessage("user", "hi")), "{{ messages }}")
    assert extra == {} and chat[0]["role"] == "system" and len(chat) == 2
    assert chat[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in chat[0]["content"]
    assert TOOLS_TURN.format(tools="").strip() in chat[0]["content"]
    alone, _ = chat_turns(request(ChatMessage("user", "hi")), "")
    assert [t["role"] for t in alone] == ["system", "user"]


def test_calls_and_answers_in_the_history_in_hugging_faces_form() -> None:
    chat, _ = chat_turns(
        request(
            ChatMessage("user", "weather?"),
            ChatMessage("assistant", "", tool_calls=CALLS),
            ChatMessage("tool", '{"sky": "clear"}', tool_call_id="call_1"),
            tools="",
        ),
        "{{ messages }}",
    )
    assert chat[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert chat[2] == {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"}
