"""LLAMAMESH_WORKER_CHAT_TEMPLATE: a Jinja file that renders chats instead of the model's own
template, checked when the worker starts (a missing, empty or broken file stops it with one line
naming the setting); with a template in the Llama 3.x form (tests/data/llama3_json_tools.jinja), the
real SmolLM2 tokenizer renders the tools, a call and a tool's answer in that form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llamamesh.types import ChatMessage, GenerationRequest
from workers.engines.prompts import prompt_text, read_chat_template, use_chat_template

pytestmark = [pytest.mark.timeout(120)]

LLAMA3 = Path(__file__).parent.parent / "data" / "llama3_json_tools.jinja"
TOOLS = json.dumps(
    [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
)
CALLS = json.dumps([{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}])


def test_no_file_keeps_the_models_own_template() -> None:
    tokenizer = SimpleNamespace(chat_template="own")
    assert read_chat_template("") is None
    assert use_chat_template(tokenizer, "").chat_template == "own"
    assert use_chat_template(tokenizer, str(LLAMA3)).chat_template == LLAMA3.read_text()


@pytest.mark.parametrize("text", [None, "", "{% if %}"], ids=["missing", "empty", "not-jinja"])
def test_a_bad_file_is_refused_naming_the_setting(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "t.jinja"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=r"^LLAMAMESH_WORKER_CHAT_TEMPLATE: "):
        read_chat_template(str(path))


def test_the_worker_stops_at_once_with_one_line_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "LLAMAMESH_WORKER_CHAT_TEMPLATE": str(tmp_path / "none.jinja")}
    done = subprocess.run([sys.executable, "-m", "workers"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: LLAMAMESH_WORKER_CHAT_TEMPLATE: ") and "none.jinja" in line


def test_the_llama3_form_renders_the_tools_a_call_and_its_answer() -> None:
    from transformers import AutoTokenizer

    from tests.contract.conftest import smollm2_folder

    tokenizer = use_chat_template(
        AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True), str(LLAMA3)
    )
    request = GenerationRequest(
        request_id="r",
        model="m",
        messages=(
            ChatMessage("system", "Be brief."),
            ChatMessage("user", "Weather in Paris?"),
            ChatMessage("assistant", "", tool_calls=CALLS),
            ChatMessage("tool", '{"sky": "clear"}', tool_call_id="call_1"),
        ),
        tools=TOOLS,
    )
    text, special = prompt_text(request, tokenizer)
    assert not special
    system, user, call, answer, prompt = text.split("<|eot_id|>")
    assert system.startswith("<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nBe brief.")
    assert '"name": "get_weather"' in system and "respond with JSON for a function call" in system
    assert user == "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?"
    assert (
        call
        == '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    )
    assert answer == '<|start_header_id|>ipython<|end_header_id|>\n\n{"sky": "clear"}'
    assert prompt == "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_a_tokenizer_that_renders_on_copies_of_itself_gets_the_template_too() -> None:
    """vLLM's tokenizer (vllm/tokenizers/hf.py, maybe_make_thread_pool) renders chats on deep copies
    of itself made when it was built, so a template set on it afterwards never reached them: the
    vLLM worker rendered the model's own template, without the tools. Built here the way vLLM 0.26
    builds it, from the real SmolLM2 tokenizer."""
    import copy

    from transformers import AutoTokenizer

    from tests.contract.conftest import smollm2_folder

    hf = AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True)
    rendering = copy.deepcopy(hf)  # what vLLM's pool renders with

    class Pooled(hf.__class__):  # type: ignore[misc, name-defined]
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            return rendering.apply_chat_template(*args, **kwargs)

    hf.__class__ = Pooled
    tokenizer = use_chat_template(hf, str(LLAMA3))
    request = GenerationRequest(
        request_id="r", model="m", messages=(ChatMessage("user", "Weather in Paris?"),), tools=TOOLS
    )
    text, _ = prompt_text(request, tokenizer)
    assert text.startswith("<|start_header_id|>system<|end_header_id|>") and '"name": "get_weather"' in text
