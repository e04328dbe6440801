"""deploy/compose/compose.cpu.yaml run for real with docker-compose: Redis with its append-only file,
a gateway, two CPU workers (the real SmolLM2-135M-Instruct) and Prometheus, from the images built
from this repository (tests/deploy/conftest.py). Only the host's loopback and the stack's own
network carry traffic: the two published ports are bound to 127.0.0.1.

From the host: grpcurl through reflection, the Python client, Prometheus's HTTP API; and Docker's
own operations on the containers: inspect, stop, kill, restart."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from llamamesh.client import Client
from llamamesh.v1 import admin_pb2 as apb
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.test_node import grpcurl
from tests.images import ROOT, docker
from tests.redisproc import free_port
from tests.waiting import until, wait_until

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

COMPOSE = ROOT / "deploy" / "compose" / "compose.cpu.yaml"
PROJECT = "llamamesh-stack-test"
SERVICES = ("redis", "gateway", "worker-a", "worker-b", "prometheus")
WORKERS = ("worker-a", "worker-b")
LONG = {"messages": [("user", "Tell a long story about a lighthouse keeper.")], "temperature": 0.0, "ignore_eos": True}


@dataclass
class Stack:
    env: dict[str, str]
    logs: Path
    started: list[str] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.env['GATEWAY_PORT']}"

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = ["docker-compose", "-p", PROJECT, "-f", str(COMPOSE), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, check=False)
        assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    def container(self, service: str) -> str:
        return f"{PROJECT}_{service}_1"

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(docker("inspect", self.container(service)).stdout)[0]

    def health(self, service: str) -> str:
        return str(self.inspect(service)["State"].get("Health", {}).get("Status", "none"))

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float) -> None:
        wait_until(
            lambda: {s: self.health(s) for s in services},
            timeout_s,
            f"{', '.join(services)} healthy",
            done=lambda h: set(h.values()) == {"healthy"},
            poll_s=0.5,
        )

    def promql(self, query: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.env['PROMETHEUS_PORT']}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def logs_of(self, service: str) -> str:
        done = docker("logs", self.container(service), check=False, timeout=60)
        return done.stdout + done.stderr


@pytest.fixture(scope="module")
def stack(
    images: dict[str, str], stand_ins: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    env = {
        **os.environ,
        "GATEWAY_IMAGE": images["gateway"],
        "WORKER_IMAGE": images["worker-cpu"],
        "REDIS_IMAGE": stand_ins["redis"],
        "PROMETHEUS_IMAGE": stand_ins["prometheus"],
        "GATEWAY_PORT": str(free_port()),
        "HTTP_PORT": str(free_port()),
        "PROMETHEUS_PORT": str(free_port()),
    }
    s = Stack(env, tmp_path_factory.mktemp("stack") / "compose.log")
    s.compose("down", "--volumes", "--timeout", "5")  # what an interrupted run left behind
    try:
        s.compose("up", "--detach", "--no-build")
        s.wait_healthy(("redis", "gateway", *WORKERS), 600)
        yield s
    finally:
        s.logs.write_text(s.compose("logs", "--no-color", "--tail", "300").stdout)
        print(f"the stack's logs: {s.logs}")
        s.compose("down", "--volumes", "--timeout", "10")


def test_every_container_is_non_root_on_a_read_only_root_with_no_added_capability(stack: Stack) -> None:
    for service in SERVICES:
        got = stack.inspect(service)
        user = got["Config"]["User"]
        assert user and user.split(":")[0] not in ("0", "root"), f"{service} runs as {user!r}"
        host = got["HostConfig"]
        assert host["ReadonlyRootfs"] is True, service
        assert not host["CapAdd"] and "ALL" in host["CapDrop"], (service, host["CapAdd"], host["CapDrop"])
        assert "no-new-privileges:true" in host["SecurityOpt"], service
        assert got["State"]["Running"] and got["RestartCount"] == 0, (service, got["State"])
        # the processes' own uid, as the kernel sees it
        uid = docker("exec", stack.container(service), "id", "-u").stdout.strip()
        assert uid == user.split(":")[0], (service, uid)
    for service in ("redis", "gateway", *WORKERS):
        assert stack.health(service) == "healthy", service


def test_grpcurl_through_reflection_streams_a_real_answer(stack: Stack) -> None:
    listed = subprocess.run(
        [grpcurl(), "-plaintext", stack.gateway, "list"], capture_output=True, text=True, timeout=60
    )
    assert "llamamesh.v1.GenerationService" in listed.stdout.split(), listed.stderr
    request = json.dumps({"prompt": "Write a haiku about the sea.", "max_tokens": 16, "ignore_eos": True})
    done = subprocess.run(
        [grpcurl(), "-plaintext", "-d", request, stack.gateway, "llamamesh.v1.GenerationService/Generate"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    messages = _json_stream(done.stdout)
    assert len(messages) > 1  # streamed, not one reply
    assert "".join(m.get("text", "") for m in messages).strip()
    assert sum(len(m.get("token_ids", [])) for m in messages) == 16
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH", messages[-1]


def test_the_openai_sdk_through_the_http_door(stack: Stack) -> None:
    base = f"http://127.0.0.1:{stack.env['HTTP_PORT']}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "Hi!"}],
                max_tokens=8,
                stream=True,
            )
        )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def _json_stream(out: str) -> list[dict[str, Any]]:
    """The JSON objects grpcurl printed one after another."""
    decoder, messages, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i].isspace():
            i += 1
            continue
        message, i = decoder.raw_decode(out, i)
        messages.append(message)
    return messages


def test_prometheus_scrapes_the_gateway_and_both_workers_and_counts_the_requests(stack: Stack) -> None:
    instances = {"gateway:9400", "worker-a:9401", "worker-b:9401"}
    wait_until(
        lambda: {r["metric"]["instance"] for r in stack.promql("up == 1")}, 60, "every target up", done=instances.__le__
    )
    # a scrape of the gateway after every earlier request ended: the count to start from
    since = time.time()
    scraped = 'timestamp(up{instance="gateway:9400"})'
    wait_until(lambda: float(stack.promql(scraped)[0]["value"][1]), 30, "a new scrape", done=lambda t: t > since)
    ok = 'sum(llamamesh_requests_total{method="Generate",code="OK"}) or vector(0)'
    before = float(stack.promql(ok)[0]["value"][1])

    async def send(n: int) -> None:
        async with Client(stack.gateway) as c:
            await asyncio.gather(*(c.complete(f"Count to {i}.", max_tokens=4) for i in range(n)))

    asyncio.run(send(3))
    wait_until(
        lambda: float(stack.promql(ok)[0]["value"][1]), 60, "3 more in Prometheus", done=lambda v: v == before + 3
    )


async def busy_throughout(c: Client, window_s: float = 2.5) -> set[str]:
    """The workers (their compose services) that the heartbeats show busy throughout ``window_s``: a
    heartbeat's count lags by up to one beat (a second), and the gateway's one-token health probes
    come and go."""
    seen: list[set[str]] = []
    for _ in range(int(window_s / 0.25)):
        backends = (await c.admin.ListBackends(apb.ListBackendsRequest())).backends
        seen.append({w.name.rsplit("-", 1)[0] for b in backends for w in b.workers if w.inflight})
        await asyncio.sleep(0.25)
    return set.intersection(*seen)


async def serving(c: Client, request_id: str, timeout_s: float) -> str:
    """The worker running the request, while only it runs."""
    (name,) = await until(
        lambda: busy_throughout(c), timeout_s, f"the worker of {request_id}", done=lambda s: len(s) == 1
    )
    return str(name)


def contiguous(got: list[pb.GenerateResponse]) -> bool:
    """Each message's index is the count of tokens before it: nothing repeated, nothing missing."""
    sent = 0
    for m in got:
        if m.token_ids:
            if m.index != sent:
                return False
            sent += len(m.token_ids)
    return True


def test_docker_stop_of_the_worker_serving_a_long_stream_ends_the_stream_whole(stack: Stack) -> None:
    n_tokens = 96

    async def run() -> tuple[list[int], list[pb.GenerateResponse], str]:
        async with Client(stack.gateway) as c:
            reference = [t async for m in c.generate(**LONG, max_tokens=n_tokens) for t in m.token_ids]
            got: list[pb.GenerateResponse] = []
            stopper: threading.Thread | None = None
            worker = ""
            async for m in c.generate(**LONG, max_tokens=n_tokens, request_id="stopped-mid-stream"):
                got.append(m)
                if stopper is None and sum(len(x.token_ids) for x in got) >= 8:
                    worker = await serving(c, "stopped-mid-stream", 10)
                    # docker stop: SIGTERM, then SIGKILL after the stop grace period; it blocks until then
                    stopper = threading.Thread(target=docker, args=("stop", stack.container(worker)), daemon=True)
                    stopper.start()
            assert stopper is not None
            await asyncio.to_thread(stopper.join, 90)
            return reference, got, worker

    reference, got, worker = asyncio.run(run())
    assert len(reference) == n_tokens
    assert [t for m in got for t in m.token_ids] == reference  # greedy: the same tokens, whole
    assert contiguous(got) and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert got[-1].usage.completion_tokens == n_tokens
    state = stack.inspect(worker)["State"]
    assert not state["Running"] and state["ExitCode"] == 0, state  # it drained and left by itself
    assert "stopped-mid-stream" in stack.logs_of(worker)  # it was the one serving it
    docker("start", stack.container(worker))
    stack.wait_healthy((worker,), 300)


def test_docker_restart_of_redis_loses_no_batch_item_and_runs_none_twice(stack: Stack) -> None:
    n = 8
    docs = [bpb.Document(custom_id=f"doc-{i}", text=f"Port {i} built a lighthouse in {1900 + i}.") for i in range(n)]
    request = bpb.BatchGenerateRequest(
        batch_id="across-a-redis-restart",
        summarise=bpb.Summarise(documents=docs, params=pb.GenerateRequest(max_tokens=8, temperature=0.0)),
    )

    async def submit() -> None:
        async with Client(stack.gateway) as c:
            b = await c.batches.BatchGenerate(request)
            assert b.counts.total == n

    asyncio.run(submit())
    docker("restart", "--time", "30", stack.container("redis"), timeout=120)  # SIGTERM: Redis writes its AOF
    stack.wait_healthy(("redis",), 60)

    async def finished() -> list[bpb.BatchResult]:
        async with Client(stack.gateway) as c:

            async def state() -> int:
                try:
                    got = await c.batches.GetBatch(bpb.GetBatchRequest(batch_id=request.batch_id))
                except grpc.aio.AioRpcError as e:  # the gateway still reconnecting: UNAVAILABLE, retry
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    return bpb.BATCH_STATE_UNSPECIFIED
                return int(got.state)

            await until(state, 240, "the batch to complete", done=lambda s: s == bpb.BATCH_STATE_COMPLETED, poll_s=0.5)
            stream = c.batches.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id=request.batch_id))
            return [r async for r in stream]

    results = asyncio.run(finished())
    assert sorted(r.custom_id for r in results) == sorted(d.custom_id for d in docs)  # each once
    assert all(r.status == bpb.BATCH_ITEM_STATUS_SUCCEEDED and r.text for r in results), results


def test_docker_kill_of_a_worker_its_running_and_queued_work_completes_on_the_other(stack: Stack) -> None:
    # Long enough that a worker is seen running them for busy_throughout's window (48 tokens took
    # 4 s on an idle machine: over before a worker's heartbeats showed it busy for 2.5 s).
    n_requests, n_tokens = 6, 160

    async def run() -> tuple[str, list[list[pb.GenerateResponse]]]:
        async with Client(stack.gateway) as c:
            streams = [
                asyncio.create_task(_collect(c, max_tokens=n_tokens, request_id=f"killed-{i}", **LONG))
                for i in range(n_requests)
            ]
            # the worker (or one of the two) running them
            busy = await until(lambda: busy_throughout(c), 60, "a worker running them", done=bool)
            victim = sorted(busy)[0]
            await asyncio.to_thread(docker, "kill", stack.container(victim))
            return victim, list(await asyncio.wait_for(asyncio.gather(*streams), 240))

    victim, outcomes = asyncio.run(run())
    assert not stack.inspect(victim)["State"]["Running"]
    for got in outcomes:
        assert sum(len(m.token_ids) for m in got) == n_tokens and contiguous(got)
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH and got[-1].usage.completion_tokens == n_tokens


async def _collect(c: Client, **kw: Any) -> list[pb.GenerateResponse]:
    return [m async for m in c.generate(**kw)]
