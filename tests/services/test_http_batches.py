"""OpenAI's Files and Batches API on the HTTP door, through the official ``openai`` SDK: an
in-process gateway with the batch service over the in-memory stores, fake-engine workers. A JSONL
file in OpenAI's format goes in, a batch runs, its output and error files come out in OpenAI's line
format; bad files are refused naming the line, and nothing of another tenant's is visible."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import pytest

from llamamesh.settings import AuthSettings, BatchSettings
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from tests.redisproc import free_port
from tests.security.secured import create_key
from tests.services.conftest import GATEWAY, Config, Stack, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def jsonl(lines: list[dict[str, object]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(i: int, **body: object) -> dict[str, object]:
    messages = [{"role": "user", "content": f"Summarise document {i}."}]
    return {
        "custom_id": f"doc-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": messages, "max_tokens": 4, **body},
    }


async def finished(client: openai.AsyncOpenAI, batch_id: str) -> object:
    async def status() -> object:
        return await client.batches.retrieve(batch_id)

    ended = ("completed", "failed", "expired", "cancelled")
    return await until(status, 30, f"batch {batch_id} to end", done=lambda b: b.status in ended, poll_s=0.05)


async def test_a_jsonl_file_runs_as_a_batch_to_its_output_file(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    _, client = openai_door
    uploaded = await client.files.create(file=("input.jsonl", jsonl([chat_line(i) for i in range(6)])), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0 and uploaded.filename == "input.jsonl"
    assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
    batch = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status in ("in_progress", "completed") and batch.request_counts is not None
    assert batch.request_counts.total == 6 and batch.metadata == {"job": "nightly"}
    done = await finished(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6 and done.request_counts.failed == 0  # type: ignore[attr-defined]
    assert done.output_file_id and done.error_file_id is None  # type: ignore[attr-defined]
    assert done.completed_at and done.in_progress_at  # type: ignore[attr-defined]
    output = (await client.files.content(done.output_file_id)).content  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in output.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"doc-{i}" for i in range(6)]  # each once
    for line in lines:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 4 and body["model"] == "tiny"
        assert done.in_progress_at - 1 <= body["created"] <= done.completed_at  # type: ignore[attr-defined]
    assert (await client.files.content(done.output_file_id)).content == output  # type: ignore[attr-defined]
    usage = done.usage  # type: ignore[attr-defined]
    assert usage.output_tokens == 24 and usage.input_tokens == sum(
        x["response"]["body"]["usage"]["prompt_tokens"] for x in lines
    )
    listed = await client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    assert (await client.files.delete(uploaded.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(uploaded.id)


async def test_the_sdk_pages_through_every_batch_once(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    stack, client = openai_door
    uploaded = await client.files.create(file=("one.jsonl", jsonl([chat_line(0)])), purpose="batch")
    made = [
        (
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        ).id
        for _ in range(5)
    ]
    listed = [b.id async for b in client.batches.list(limit=2)]  # the SDK follows has_more and last_id
    assert listed == made[::-1]
    grpc_batches = batch_pb2_grpc.BatchServiceStub(stack.channel)  # type: ignore[no-untyped-call]
    for i in range(120):  # newer batches made over gRPC (no OpenAI form) hide none of the door's
        item = bpb.BatchItem(custom_id="a", request=pb.GenerateRequest(prompt="x", max_tokens=1))
        await grpc_batches.BatchGenerate(bpb.BatchGenerateRequest(batch_id=f"grpc-{i}", items=[item]))
    assert [b.id async for b in client.batches.list(limit=2)] == made[::-1]
    page = await client.batches.list()
    assert [b.id for b in page.data] == made[::-1] and not page.has_more


@pytest.mark.fake_step_s(0.05)
async def test_a_cancelled_batch_writes_its_unrun_items_to_the_error_file(
    openai_door: tuple[Stack, openai.AsyncOpenAI],
) -> None:
    _, client = openai_door
    lines = [chat_line(i, max_tokens=40) for i in range(30)]
    uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await finished(client, batch.id)
    assert done.status == "cancelled" and done.error_file_id  # type: ignore[attr-defined]
    errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).content.splitlines()]  # type: ignore[attr-defined]
    assert errors and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
    counts = done.request_counts  # type: ignore[attr-defined]
    assert counts.completed + counts.failed == 30 and counts.failed == len(errors)


async def test_bad_files_and_bad_batches_are_400_naming_the_line(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    _, client = openai_door
    bad = [
        chat_line(0),
        {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}},
        chat_line(2),
        {"not": "a request"},  # no custom_id
        chat_line(4, temperature=-1),  # well-formed, refused by the batch service
        {"custom_id": "nb", "method": "POST", "url": "/v1/chat/completions"},
        chat_line(0),  # a repeated custom_id
    ]
    uploaded = await client.files.create(file=("bad.jsonl", jsonl(bad) + b"{not json\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    message = exc.value.message
    assert exc.value.param == "line 2: url"
    assert all(f"line {n}:" in message for n in (2, 4, 5, 6, 7, 8)), message  # every bad line, in one answer
    assert "line 5: body.temperature" in message and "line 6: body:" in message, message
    assert "line 4: custom_id: required" in message, message
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="0h")
    assert exc.value.param == "completion_window", exc.value.body
    # the batch service's own checks, named by the file's lines and the body's fields
    sampling = await client.files.create(
        file=("s.jsonl", jsonl([chat_line(0), chat_line(1, temperature=-1)])), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=sampling.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert exc.value.param == "line 2: body.temperature", exc.value.body
    # a repeated custom_id and an unknown model, named by the file's lines (a blank line counts)
    dup = await client.files.create(
        file=("dup.jsonl", jsonl([chat_line(0)]) + b"\n" + jsonl([chat_line(1), chat_line(0)])), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert exc.value.param == "line 4: custom_id" and "the custom_id of line 1 too" in exc.value.message, exc.value.body
    unknown = jsonl([chat_line(0)]) + b"\n" + jsonl([chat_line(1, model="nope")])
    nope = await client.files.create(file=("nope.jsonl", unknown), purpose="batch")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.batches.create(input_file_id=nope.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "line 3 ('doc-1'): model 'nope' is not served here" in missing.value.message, missing.value.body
    assert missing.value.code == "model_not_found", missing.value.body  # as OpenAI's, and as a completion's
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=dup.id, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore[arg-type]
    assert exc.value.param == "endpoint"
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id="", endpoint="/v1/chat/completions", completion_window="24h")
    assert exc.value.param == "input_file_id"
    ok = {"custom_id": "ok", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x", "max_tokens": 2}}
    lone = b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "\\ud800"}}\n'  # not text
    surrogate = await client.files.create(file=("s.jsonl", jsonl([ok]) + lone), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=surrogate.id, endpoint="/v1/completions", completion_window="24h")
    assert exc.value.param == "line 2: body.prompt", exc.value.body
    several = {**ok, "custom_id": "b", "body": {"prompt": ["x", "y"]}}  # a line is one request
    two = await client.files.create(file=("p.jsonl", jsonl([ok, several])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        await client.batches.create(input_file_id=two.id, endpoint="/v1/completions", completion_window="24h")
    assert exc.value.param == "line 2: body.prompt", exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        await client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert exc.value.param == "purpose"
    files = f"{client.base_url}files"  # (base_url ends in "/")
    not_multipart = [
        ("multipart/form-data; boundary=zzz", b"garbage"),  # no boundary in the body
        ("multipart/form-data", b"x"),  # no boundary at all
        ("multipart/form-data; boundary=zzz", b'--zzz\r\nContent-Disposition: form-data; name="file"\r\n\r\n{}'),
    ]  # the last one cut short, as by a client gone mid-upload
    async with aiohttp.ClientSession() as s:
        for content_type, body in not_multipart:
            async with s.post(files, data=body, headers={"content-type": content_type}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "file", (body, await r.text())
        for name in (b"a\x00b", b"x" * 1000, b"a\x7fb", b"\xff"):  # a file name that is not one
            body = (
                b'--zzz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--zzz\r\nContent-Disposition: form-data; name="file"; filename="'
                + name
                + b'"\r\n\r\n'
                + jsonl([ok])
                + b"\r\n--zzz--\r\n"
            )
            async with s.post(files, data=body, headers={"content-type": "multipart/form-data; boundary=zzz"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "file", (name, await r.text())
        purpose_part = b'--zzz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
        file_part = b'--zzz\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
        not_text = b"\xffbatch\r\n" + file_part + jsonl([ok]) + b"\r\n--zzz--\r\n"
        for purpose in (b"b" * 100_000, not_text):  # too long (and never ended); not text
            async with s.post(
                files, data=purpose_part + purpose, headers={"content-type": "multipart/form-data; boundary=zzz"}
            ) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "purpose", await r.text()


async def test_another_tenants_files_and_batches_are_not_found(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    _, client = openai_door
    uploaded = await client.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = client.with_options(default_headers={"x-llamamesh-tenant": "someone-else"})
    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert (await other.batches.list()).data == [] and (await other.files.list()).data == []


async def test_the_sdk_lists_the_files_uploaded(openai_door: tuple[Stack, openai.AsyncOpenAI]) -> None:
    _, client = openai_door
    made = [
        (await client.files.create(file=(f"{n}.jsonl", jsonl([chat_line(n)])), purpose="batch")).id for n in range(3)
    ]
    assert [f.id async for f in client.files.list(limit=2)] == made[::-1]  # the SDK follows has_more and after
    assert [f.id async for f in client.files.list(order="asc", purpose="batch")] == made
    await client.files.delete(made[1])
    listed = await client.files.list()
    assert [f.id for f in listed.data] == [made[2], made[0]] and listed.data[0].filename == "2.jsonl"
    with pytest.raises(openai.BadRequestError) as exc:
        await client.files.list(limit=0)
    assert exc.value.param == "limit"


async def test_the_batch_usage_counts_the_prompt_tokens_the_engine_had_cached(
    openai_door: tuple[Stack, openai.AsyncOpenAI],
) -> None:
    _, client = openai_door
    same = [{**chat_line(0), "custom_id": f"same-{i}"} for i in range(4)]  # one prompt, four times
    uploaded = await client.files.create(file=("same.jsonl", jsonl(same)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await finished(client, batch.id)
    usage = done.usage  # type: ignore[attr-defined]
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens * 3 // 4  # every run but the first


async def test_a_tenants_uploads_hold_at_most_its_batch_bytes(tmp_path: Path) -> None:
    """Uploaded files count against the tenant's max_batch_bytes: one that would pass it is 429
    naming the limit, and a deletion makes room again."""
    auth = tmp_path / "tenants.json"
    key = create_key(auth, "alpha")
    tenants = json.loads(auth.read_text())
    tenants["tenants"]["alpha"] = {"limits": {"max_batch_bytes": 1000}}
    auth.write_text(json.dumps(tenants))
    port = free_port()
    config = Config(gateway=replace(GATEWAY, http_port=port), batches=True, auth=AuthSettings(file=str(auth)))
    async with (
        running(config),
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) as client,
    ):
        first = await client.files.create(file=("a.jsonl", b"x" * 600), purpose="batch")
        with pytest.raises(openai.RateLimitError) as exc:
            await client.files.create(file=("b.jsonl", b"x" * 600), purpose="batch")
        assert "LLAMAMESH_LIMITS_MAX_BATCH_BYTES" in exc.value.message and exc.value.response.headers["retry-after"]
        await client.files.delete(first.id)
        await client.files.create(file=("b.jsonl", b"x" * 600), purpose="batch")


async def test_an_output_line_has_the_logprobs_a_single_request_gets(
    openai_door: tuple[Stack, openai.AsyncOpenAI],
) -> None:
    _, client = openai_door
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 4}
    text = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "seed": 4, "logprobs": 1}
    asked = {**chat, "logprobs": True, "top_logprobs": 1}
    for endpoint, body, alone in (
        ("/v1/chat/completions", asked, (await client.chat.completions.create(**asked)).choices[0].logprobs),  # type: ignore[call-overload]
        ("/v1/completions", text, (await client.completions.create(**text)).choices[0].logprobs),  # type: ignore[call-overload]
        ("/v1/chat/completions", chat, None),
    ):
        line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
        uploaded = await client.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
        done = await finished(client, batch.id)
        (out,) = [json.loads(x) for x in (await client.files.content(done.output_file_id)).content.splitlines()]  # type: ignore[arg-type]
        got = out["response"]["body"]["choices"][0]["logprobs"]
        assert (type(alone).model_validate(got) if alone is not None else got) == alone, (endpoint, got)


async def test_a_file_of_more_lines_than_a_batch_takes_is_400_naming_the_file() -> None:
    """The batch service's own limits name OpenAI's fields: its items are the input file's lines."""
    port = free_port()
    config = Config(gateway=replace(GATEWAY, http_port=port), batches=True, gateway_batch=BatchSettings(max_items=2))
    async with (
        running(config),
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client,
    ):
        uploaded = await client.files.create(
            file=("in.jsonl", jsonl([chat_line(i) for i in range(3)])), purpose="batch"
        )
        with pytest.raises(openai.BadRequestError) as exc:
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert exc.value.param == "input_file_id" and "3 items; at most 2" in exc.value.message, exc.value.body


async def test_a_failed_items_error_line_names_its_field_as_a_request_would(
    openai_door: tuple[Stack, openai.AsyncOpenAI],
) -> None:
    """An item the worker refuses (its prompt longer than the model) is a line of the error file
    whose body is the error a single request gets, the field at fault named as the request names it."""
    _, client = openai_door
    too_long = chat_line(1)
    too_long["body"]["messages"] = [{"role": "user", "content": "word " * 5000}]  # type: ignore[index]
    uploaded = await client.files.create(file=("in.jsonl", jsonl([chat_line(0), too_long])), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await finished(client, batch.id)
    assert done.request_counts.completed == 1 and done.request_counts.failed == 1  # type: ignore[attr-defined]
    (line,) = [json.loads(x) for x in (await client.files.content(done.error_file_id)).content.splitlines()]  # type: ignore[attr-defined]
    error = line["response"]["body"]["error"]
    assert line["custom_id"] == "doc-1" and line["response"]["status_code"] == 400, line
    assert error["param"] == "messages" and error["code"] == "prompt_too_long", error
    assert error["message"].startswith("messages: "), error  # the field as the request names it, there too
