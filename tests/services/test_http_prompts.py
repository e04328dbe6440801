"""``/v1/completions`` with a list of prompts, as OpenAI's and vLLM's servers take it: one generation
per prompt, answered together, prompt p's sample s as choice p * n + s, the usage of all of them;
whole or streamed, through the ``openai`` SDK against an in-process gateway and the fake engine."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import openai
import pytest

from llamamesh.settings import LimitsSettings
from services.http.openai_requests import MAX_PROMPTS
from tests.redisproc import free_port
from tests.services.conftest import GATEWAY, Config, Stack, running
from tests.services.test_http_door import client, door  # noqa: F401 (fixtures)
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["Once upon a time", "The capital of France is", "Roses are red"]


async def test_several_prompts_whole_each_n_times(door: tuple[Stack, str], client: openai.AsyncOpenAI) -> None:  # noqa: F811
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt=PROMPTS, max_tokens=3, n=2, temperature=0.8, extra_headers={"x-request-id": "many"}
    )
    got = raw.parse()
    assert raw.headers["x-request-id"] == "many" and got.id == "cmpl-many"
    assert [c.index for c in got.choices] == list(range(6))
    assert all(c.text and c.finish_reason == "length" for c in got.choices)
    served = {r.partition("~")[0] for r in door[0].engine.served}  # (the engine's id: the tenant's, per sample)
    assert {"many:0", "many:1", "many:2"} <= served, served
    alone = [await client.completions.create(model="tiny", prompt=p, max_tokens=3) for p in PROMPTS]
    assert got.usage is not None and got.usage.completion_tokens == 6 * 3
    assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)


async def test_several_prompts_streamed_with_usage(client: openai.AsyncOpenAI) -> None:  # noqa: F811
    stream = await client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 3 * 4


@pytest.mark.fake_step_s(0.05)
async def test_a_bad_list_of_prompts_is_400_naming_it(door: tuple[Stack, str], client: openai.AsyncOpenAI) -> None:  # noqa: F811
    cases = [
        ([], "required"),
        ([[1, 2, 3]], "token ids"),
        ([1, 2], "token ids"),
        (["ok", 5], "must be a string"),
        (["x"] * (MAX_PROMPTS + 1), "at most"),
    ]
    for prompt, says in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(model="tiny", prompt=prompt, max_tokens=2)  # type: ignore[arg-type]
        param = "prompt[1]" if prompt == ["ok", 5] else "prompt"
        assert exc.value.param == param and says in exc.value.message, (prompt, exc.value.body)

    # one prompt longer than the model (the fake engine's 2048): the whole request is refused, naming it,
    # and the others' generations do not run on
    async def answer(stream: bool, prompt: list[str], max_tokens: int = 200) -> None:
        got = await client.completions.create(  # type: ignore[call-overload]
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=stream
        )
        async for _ in got:
            pass

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            await answer(stream, ["short", "word " * 3000])
        assert exc.value.code == "prompt_too_long" and exc.value.param == "prompt[1]", exc.value.body
    # streamed, even when the others' tokens come first (the long prompt waits for a slot of the worker's
    # 8): the stream begins once every prompt has begun
    with pytest.raises(openai.BadRequestError) as exc:
        await answer(True, ["short"] * 8 + ["word " * 3000], max_tokens=4)
    assert exc.value.code == "prompt_too_long" and exc.value.param == "prompt[8]", exc.value.body
    await until(lambda: door[0].queue.pending("cpu") == {}, 10, "no job left leased")


async def test_a_long_request_id_fits_each_prompts_id_or_is_400_saying_how_long(
    door: tuple[Stack, str],  # noqa: F811
    client: openai.AsyncOpenAI,  # noqa: F811
) -> None:
    """Prompt i's id is <x-request-id>:<i>: a 128-character id serves one prompt; with several, the
    400 names x-request-id and the length that fits, and one that fits is served."""
    one = await client.completions.create(
        model="tiny", prompt="hi", max_tokens=2, extra_headers={"x-request-id": "a" * 128}
    )
    assert one.id == "cmpl-" + "a" * 128
    for n, most in ((2, 126), (11, 125)):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.completions.create(
                model="tiny", prompt=["hi"] * n, max_tokens=2, extra_headers={"x-request-id": "b" * (most + 1)}
            )
        assert exc.value.param == "x-request-id" and f"at most {most} characters" in exc.value.message
        got = await client.completions.create(
            model="tiny", prompt=["hi"] * n, max_tokens=2, extra_headers={"x-request-id": "c" * most}
        )
        assert len(got.choices) == n
    served = {r.partition("~")[0] for r in door[0].engine.served}
    assert "c" * 125 + ":10" in served, served


async def test_chat_text_parts_are_one_line_each(door: tuple[Stack, str], client: openai.AsyncOpenAI) -> None:  # noqa: F811
    """As vLLM's server joins them: parts ["hi", "there"] are the prompt "hi\nthere", not "hithere"."""
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]

    async def prompt_tokens(content: object) -> int:
        got = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            max_tokens=1,
        )
        assert got.usage is not None
        return got.usage.prompt_tokens

    assert await prompt_tokens(parts) == await prompt_tokens("hi\nthere") != await prompt_tokens("hithere")


@pytest.mark.fake_step_s(0.05)
async def test_a_caller_that_goes_away_cancels_every_prompt(door: tuple[Stack, str]) -> None:  # noqa: F811
    stack = door[0]
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 400, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{door[1]}/completions", json=body, headers={"x-request-id": "away"}) as r,
    ):
        await r.content.readline()  # the first event: they run
    every = lambda: all(any(a.endswith(f"away:{i}") for a in stack.engine.aborted) for i in range(3))  # noqa: E731
    await until(every, 10, "every prompt's generation aborted")
    await until(lambda: stack.queue.pending("cpu") == {}, 10, "every job acknowledged")


async def test_more_prompts_than_the_tenant_may_stream_at_once_is_400_not_429() -> None:
    """Each prompt holds one of the tenant's streams: a request of more than max_streams prompts could
    never be admitted, so it is refused as invalid (retrying it would not help), naming prompt."""
    port = free_port()
    config = Config(gateway=replace(GATEWAY, http_port=port), limits=LimitsSettings(max_streams=2))
    async with (
        running(config),
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as c,
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            await c.completions.create(model="tiny", prompt=["a", "b", "c"], max_tokens=2)
        assert exc.value.param == "prompt" and "LLAMAMESH_LIMITS_MAX_STREAMS" in exc.value.message, exc.value.body
        got = await c.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
        assert len(got.choices) == 2
