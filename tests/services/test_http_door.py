"""The OpenAI-compatible HTTP door through the official ``openai`` SDK (async and sync), and raw HTTP
for what the SDK hides: an in-process gateway with its HTTP port open, a fake-engine worker, the
in-memory queue. The same servicer as gRPC answers, so what holds there (conversion, validation,
admission) is checked there; here: OpenAI's shapes, streaming, errors and cancellation."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import openai
import pytest
import structlog

from llamamesh import metrics
from services.http import wire
from tests.redisproc import free_port
from tests.services.conftest import GATEWAY, Config, Stack, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def door(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Stack, str]]:
    port = free_port()
    config = Config(gateway=replace(GATEWAY, http_port=port))
    if marker := request.node.get_closest_marker("fake_step_s"):
        config = config.stepping(marker.args[0])
    async with running(config) as stack:
        yield stack, f"http://127.0.0.1:{port}/v1"


@pytest.fixture
async def client(door: tuple[Stack, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door[1], api_key="unused", max_retries=0) as c:
        yield c


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


async def test_a_chat_completion_whole_with_its_usage_and_request_id(client: openai.AsyncOpenAI) -> None:
    with structlog.testing.capture_logs() as logs:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=CHAT,
            max_tokens=5,
            extra_headers={"x-request-id": "chat-1"},
            user="alice",
            metadata={"team": "search"},
        )
    (line,) = [e for e in logs if e["event"] == "rpc_finished"]
    assert line["method"] == "ChatCompletions" and line["labels"] == {"team": "search", "user": "alice"}
    assert raw.headers["x-request-id"] == "chat-1"
    got = raw.parse()
    assert got.id == "chatcmpl-chat-1" and got.object == "chat.completion" and got.model == "tiny"
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert got.usage is not None and got.usage.completion_tokens == 5 and got.usage.prompt_tokens > 0
    assert got.usage.total_tokens == got.usage.prompt_tokens + 5
    details = got.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0  # a prompt the engine has not seen


async def test_a_repeated_prompt_reports_its_cached_tokens(client: openai.AsyncOpenAI) -> None:
    """The engine's prefix-cache hits reach the caller (the fake engine reports a repeated input as
    cached whole), in OpenAI's prompt_tokens_details."""
    messages = [{"role": "user", "content": "The same question twice."}]
    first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    again = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens > 0


async def test_a_streamed_chat_completion_ends_with_usage_and_done(door: tuple[Stack, str]) -> None:
    body = {
        "model": "tiny",
        "messages": CHAT,
        "max_completion_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as s, s.post(f"{door[1]}/chat/completions", json=body) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.decode().removeprefix("data: ").strip() async for line in r.content if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI's form: null but the last


async def test_the_sdk_streams_a_chat_and_parallel_samples(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, n=2, temperature=0.8, seed=3, stream=True
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str | None] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert all(texts.values()) and finished == {0: "length", 1: "length"}


async def test_completions_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    got = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3, logprobs=2)
    assert got.object == "text_completion" and got.choices[0].text and got.choices[0].finish_reason == "length"
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.top_logprobs is not None and len(lp.top_logprobs) == 3 and lp.token_logprobs is not None
    pieces = [
        c.choices[0].text
        async for c in await client.completions.create(model="", prompt="Hi", max_tokens=3, stream=True)
    ]
    assert "".join(pieces)


async def test_the_models_listed(client: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in client.models.list()]
    assert models == ["tiny", "other"]
    assert (await client.models.retrieve("other")).id == "other"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


async def test_bad_requests_are_400_naming_the_callers_field(client: openai.AsyncOpenAI) -> None:
    cases = [
        ({"temperature": -1.0}, "temperature"),
        ({"max_completion_tokens": 100000}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"42": -100}}, "logit_bias"),  # refused, not ignored: it would change the answer
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="tiny", messages=CHAT, **fields)  # type: ignore[call-overload]
        assert exc.value.status_code == 400 and exc.value.param == param, (fields, exc.value.body)
        assert exc.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])  # type: ignore[list-item, misc]
    assert exc.value.param == "messages[0].role"
    odd = [
        ([], "messages", "at least one message"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0]", "must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]", "only text parts"),
    ]
    for messages, param, why in odd:
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
        assert exc.value.param == param and why in exc.value.message, exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="tiny", messages=CHAT, user="u" * 100_000)
    assert exc.value.param == "user", exc.value.body  # (it becomes the request's label)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found", missing.value.body
    with pytest.raises(openai.BadRequestError) as exc:  # an error answer carries the request's id too
        await client.chat.completions.create(model="tiny", messages=CHAT, n=0, extra_headers={"x-request-id": "bad-1"})
    assert exc.value.response.headers["x-request-id"] == "bad-1"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="tiny", messages=CHAT, n=0)
    assert exc.value.response.headers["x-request-id"]  # made for it
    models = await client.models.with_raw_response.list(extra_headers={"x-request-id": "models-1"})
    assert models.headers["x-request-id"] == "models-1"  # every answer, not only completions'
    assert (await client.models.with_raw_response.retrieve("tiny")).headers["x-request-id"]


async def test_a_prompt_longer_than_the_model_is_400_whether_streamed_or_not(client: openai.AsyncOpenAI) -> None:
    long = [{"role": "user", "content": "word " * 3000}]  # the fake engine's limit: 2048

    async def answer(stream: bool) -> None:
        got = await client.chat.completions.create(model="tiny", messages=long, stream=stream)  # type: ignore[call-overload]
        async for _ in got:  # (a stream that began with 200 would raise a bare APIError here)
            pass

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            await answer(stream)
        assert exc.value.code == "prompt_too_long" and exc.value.param, (stream, exc.value.body)


async def test_what_is_not_json_or_not_here_is_answered_in_openais_shape(door: tuple[Stack, str]) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{door[1]}/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "body"
        async with s.post(f"{door[1]}/chat/completions", json=["a list"]) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "body"
        huge = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (GATEWAY.max_request_bytes + 1)}]}
        async with s.post(f"{door[1]}/chat/completions", data=io.BytesIO(json.dumps(huge).encode())) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == "body" and "MAX_REQUEST_BYTES" in error["message"]
        hostile = [
            b"[" * 100_000 + b"]" * 100_000,  # nesting past Python's stack
            json.dumps({"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 10**12}).encode(),
            json.dumps({"model": "tiny", "messages": CHAT, "n": -1, "seed": 2**70}).encode(),
            json.dumps({"model": "tiny", "messages": CHAT, "stop_token_ids": [2**40]}).encode(),
        ]
        for data in hostile:
            async with s.post(f"{door[1]}/chat/completions", data=io.BytesIO(data)) as r:
                assert r.status == 400, (r.status, await r.text())
        async with s.post(f"{door[1]}/completions", json={"prompt": "x", "logprobs": 2**40}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "logprobs"
        huge = b'{"prompt": "x", "max_tokens": ' + b"9" * 4000 + b"}"  # not echoed back whole
        async with s.post(f"{door[1]}/completions", data=io.BytesIO(huge)) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == "max_tokens" and len(error["message"]) < 200, error
        for legacy in ({"echo": True}, {"best_of": 2}, {"suffix": "!"}, {"best_of": True}):  # refused, not ignored
            async with s.post(f"{door[1]}/completions", json={"prompt": "x", **legacy}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == next(iter(legacy)), legacy
        async with s.post(f"{door[1]}/completions", json={"prompt": "x", "max_tokens": 2, "echo": False}) as r:
            assert r.status == 200  # the defaults, as the SDKs may send them
        lone = [  # a string that is not text: an escaped lone surrogate, or its UTF-8 form
            (
                "chat/completions",
                b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
                "messages[0].content",
            ),
            ("completions", b'{"model": "tiny", "prompt": "x", "stop": ["\xed\xa0\x80"]}', "stop[0]"),
            ("completions", b'{"model": "tiny", "prompt": "x", "metadata": {"\\udfff": "v"}}', "metadata"),
        ]
        for path, data, param in lone:
            async with s.post(f"{door[1]}/{path}", data=io.BytesIO(data)) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param, await r.text()
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        choices = [  # named as OpenAI's request names them, not as the gateway's message does
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [tool], "tool_choice": "bogus"}, "tool_choice"),
            (
                {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                "tool_choice.function.name",
            ),
        ]
        for fields, param in choices:
            async with s.post(f"{door[1]}/chat/completions", json={"messages": CHAT, **fields}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param, await r.text()
        async with s.get(f"{door[1]}/no/such/path") as r:
            error = (await r.json())["error"]
            assert r.status == 404 and error["type"] == "not_found_error"
        async with s.delete(f"{door[1]}/chat/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST" and (await r.json())["error"]
    for path in ("completions", "chat/completions"):  # an x-request-id that is not even UTF-8 text
        body = b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}'
        head = f"POST /v1/{path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n".encode()
        head += b"x-request-id: \xe9\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        reader, writer = await asyncio.open_connection(*door[1].split("//")[1].split("/")[0].split(":"))
        writer.write(head + body)
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        status, _, rest = reply.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 400") and b'"param": "x-request-id"' in rest, reply


@pytest.mark.fake_step_s(0.05)
async def test_a_caller_that_goes_away_cancels_its_request(door: tuple[Stack, str]) -> None:
    """Closing a stream mid-way cancels the request, as a gRPC cancel does: the engine aborts it,
    its job is acknowledged, and the call ends CANCELLED."""
    stack = door[0]
    cancelled = metrics.REQUESTS.labels("ChatCompletions", "CANCELLED", "cpu")
    before = cancelled._value.get()
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 400, "stream": True}
    headers = {"x-request-id": "goes-away"}
    async with aiohttp.ClientSession() as s, s.post(f"{door[1]}/chat/completions", json=body, headers=headers) as r:
        await r.content.readline()  # the first event: it runs
    aborted = lambda: "goes-away" in stack.engine.aborted and stack.queue.pending("cpu") == {}  # noqa: E731
    await until(aborted, 10, "the engine's abort and the job's ack")
    await until(lambda: cancelled._value.get() > before, 10, "the call to end CANCELLED")
    # The same id again (an SDK's retry after its own timeout): not the cut-off answer as a success,
    # nor an end OpenAI's answers do not have, but an error saying what to do.
    for stream in (False, True):
        async with aiohttp.ClientSession() as s:
            again = {**body, "stream": stream}
            async with s.post(f"{door[1]}/chat/completions", json=again, headers=headers) as r:
                text = await r.text()
        assert "abort" not in text and "send it again under a new x-request-id" in text, text
        assert r.status == 400 or (stream and r.status == 200 and text.rstrip().endswith("}")), (r.status, text)


async def test_the_sync_sdk_too(door: tuple[Stack, str]) -> None:
    def sync() -> str:
        with openai.OpenAI(base_url=door[1], api_key="unused", max_retries=0) as c:
            got = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)  # type: ignore[arg-type]
            return got.choices[0].message.content or ""

    assert await asyncio.to_thread(sync)


async def test_a_reused_request_id_with_another_body_is_409(client: openai.AsyncOpenAI) -> None:
    headers = {"x-request-id": "reused"}
    await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_headers=headers)  # type: ignore[arg-type]
    with pytest.raises(openai.ConflictError) as exc:
        await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, extra_headers=headers)  # type: ignore[arg-type]
    assert exc.value.status_code == 409 and exc.value.type == "conflict_error"


async def test_no_worker_is_503_and_a_full_process_is_429_with_retry_after() -> None:
    port = free_port()
    settings = replace(GATEWAY, http_port=port, no_worker_wait_s=0.2, max_concurrent_rpcs=1)
    async with (
        running(Config(gateway=settings).stepping(0.05)),
        aiohttp.ClientSession() as s,
    ):
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with s.post(url, json={"model": "other", "messages": CHAT, "max_tokens": 2}) as r:  # pool gpu: no worker
            body = await r.json()
            assert r.status == 503 and body["error"]["type"] == "service_unavailable_error", body
        async with s.post(url, json={"model": "tiny", "messages": CHAT, "max_tokens": 200, "stream": True}) as held:
            await held.content.readline()  # one call open: the process's most
            async with s.post(url, json={"model": "tiny", "messages": CHAT, "max_tokens": 2}) as r:
                body = await r.json()
                assert r.status == 429 and body["error"]["type"] == "rate_limit_error", body
                assert int(r.headers["Retry-After"]) >= 1


async def test_a_stream_that_ends_in_an_error_event_is_logged_with_its_status(door: tuple[Stack, str]) -> None:
    body = {"model": "tiny", "prompt": "__raise__ after the first token", "max_tokens": 8, "stream": True}
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as s, s.post(f"{door[1]}/completions", json=body) as r:
            assert r.status == 200
            events = [line async for line in r.content if line.strip()]
    assert b'"error"' in events[-1]  # the error as the last event, after the first token
    (line,) = [e for e in logs if e["event"] == "rpc_finished"]
    assert line["status"] not in ("ok", "OK") and line["error"], line


async def test_a_body_that_stalls_is_refused(door: tuple[Stack, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose body stops short of its Content-Length is answered 400 naming body once
    wire.BODY_S passed (here 0.5 s), not held open for ever."""
    monkeypatch.setattr(wire, "BODY_S", 0.5)
    port = int(door[1].split(":")[2].split("/")[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    writer.write(head.encode() + b'{"prompt": "x",')
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(4096), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400") and b'"param": "body"' in answer, answer


async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit() -> None:
    """A body sent in chunks (no Content-Length to check first) is read only up to
    LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES: the 400 comes while the client is still sending, though
    the door also takes uploads of up to LLAMAMESH_BATCH_MAX_BYTES (64 MiB) on other routes."""
    port = free_port()
    async with running(Config(gateway=replace(GATEWAY, http_port=port, max_request_bytes=65536), batches=True)):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(4):  # 128 KiB, and never the last chunk
            writer.write(b"8000\r\n" + b" " * 0x8000 + b"\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400") and b'"param": "body"' in answer, answer
    assert b"more than 65536 bytes" in answer, answer


async def test_a_caller_gone_mid_body_is_a_cancelled_call_not_a_server_error(
    door: tuple[Stack, str], caplog: pytest.LogCaptureFixture
) -> None:
    port = int(door[1].split(":")[2].split("/")[0])
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with structlog.testing.capture_logs() as logs, caplog.at_level(logging.INFO):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n1\r\n{{\r\n".encode())
        await writer.drain()
        writer.transport.abort()
        await until(lambda: [e for e in logs if e["event"] == "rpc_finished"], 10, "the call to end")
    (line,) = [e for e in logs if e["event"] == "rpc_finished"]
    assert line["status"] == "CANCELLED", line
    assert not [e for e in logs if e.get("log_level") == "error"], logs
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


async def test_a_request_head_that_is_not_http_is_refused_without_echoing_it(
    door: tuple[Stack, str], caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's own answer to a bad request head quotes the bytes its parser stopped at: here an API
    key. The door answers in OpenAI's shape with the parser's error kind alone, and logs only that."""
    port = int(door[1].split(":")[2].split("/")[0])
    key = "lm_secret_key_0123456789"
    bad_heads = [
        f"Authorization: Bearer {key}{'0' * 9000}",  # a header line past aiohttp's 8190 bytes
        f"Authorization: Bearer {key}\x01",  # a control character in a value
        f"Authorization Bearer {key}",  # no colon
    ]
    with caplog.at_level(logging.INFO):
        for line in bad_heads:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{line}\r\n\r\n".encode())
            answer = await asyncio.wait_for(reader.read(), 10)  # (and the connection is closed)
            writer.close()
            assert answer.split(b" ")[1] == b"400" and key.encode() not in answer, answer  # (HTTP/1.0: unparsed)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"application/json" in head, head
            error = json.loads(body)["error"]
            assert error["param"] == "request" and error["message"].startswith("request: not valid HTTP ("), error
    refused = [r.getMessage() for r in caplog.records if "http_request_refused" in r.getMessage()]
    assert len(refused) == 3 and not any(key in r.getMessage() for r in caplog.records), refused


@pytest.mark.fake_step_s(0.02)
async def test_a_caller_reset_mid_stream_is_no_server_error(
    door: tuple[Stack, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A caller that resets its connection mid-answer is logged as gone (info), not as an error
    with a traceback."""
    port = int(door[1].split(":")[2].split("/")[0])
    body = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 300, "stream": True}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head.encode() + body)
            await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # it streams
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            writer.transport.abort()
        await until(lambda: door[0].queue.pending("cpu") == {}, 10, "every job cancelled")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
