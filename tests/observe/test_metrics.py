"""Prometheus metrics end to end: real processes (redis-server, the gateway, a worker on the fake
engine) with their metrics ports on, scraped by a real Prometheus (Debian's ``prometheus``), and
PromQL over its HTTP API after N known requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from tests.e2e.conftest import ProcessNode, e2e_redis
from tests.observe.test_rules import RATE_INTERVAL, alert_rules, dashboard_exprs, metric_names
from tests.redisproc import RedisProcess, free_port
from tests.waiting import until, wait_until

__all__ = ["e2e_redis"]  # the session's Redis fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PROMETHEUS = shutil.which("prometheus")
N = 7
MAX_TOKENS = 5


class Prometheus:
    """A Prometheus server scraping ``targets`` every second, its data in ``workdir``."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: llamamesh\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        self.log = workdir / "prometheus.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=out,
            )
        wait_until(self._ready, 30, "Prometheus to be ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, promql: str) -> float | None:
        """The instant value of a scalar-ish PromQL query (None: no series)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def answer(self, promql: str) -> dict[str, Any]:
        """Prometheus's whole JSON answer to an instant query, an error (4xx with a JSON body) too."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.load(r)  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            return json.load(exc)  # type: ignore[no-any-return]

    def wait_for(self, promql: str, want: float, timeout_s: float = 30) -> None:
        """Poll until ``promql`` gives ``want`` (Prometheus scraped after the requests), bounded."""
        wait_until(
            lambda: self.query(promql), timeout_s, f"{promql} = {want}", done=lambda got: got == want, poll_s=0.25
        )

    def up(self) -> float | None:
        return self.query("sum(up)")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


async def generate(address: str, n: int, channels: int = 1) -> None:
    """``n`` Generates of MAX_TOKENS tokens each, over ``channels`` channels of their own connection."""
    chans = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)
    ]
    try:
        stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in chans]

        async def one(i: int) -> int:
            req = pb.GenerateRequest(prompt=f"count {i}", max_tokens=MAX_TOKENS, ignore_eos=True)
            tokens = 0
            async for m in stubs[i % len(stubs)].Generate(req, timeout=30):
                tokens += len(m.token_ids)
            return tokens

        got = await asyncio.gather(*(one(i) for i in range(n)))
        assert got == [MAX_TOKENS] * n
    finally:
        for c in chans:
            await c.close()


def node_with_metrics(tmp_path: Path, redis: RedisProcess, **extra: str) -> tuple[ProcessNode, int, int]:
    gw, wk = free_port(), free_port()
    env = {"LLAMAMESH_GATEWAY_METRICS_PORT": str(gw), "LLAMAMESH_WORKER_METRICS_PORT": str(wk), **extra}
    return ProcessNode(tmp_path, redis, engine="fake", extra_env=env), gw, wk


@contextlib.contextmanager
def scraped(
    tmp_path: Path,
    redis: RedisProcess,
    worker: bool = True,
    ready: Callable[[ProcessNode], None] | None = None,
    **extra: str,
) -> Iterator[tuple[ProcessNode, Prometheus, int, int]]:
    """A started node with metrics on and a Prometheus scraping its gateway (and ``worker``'s)
    port, up; ``ready``: waits on the started node before the scraping starts. Stops both."""
    node, gw, wk = node_with_metrics(tmp_path, redis, **extra)
    prom: Prometheus | None = None
    try:
        node.start(timeout_s=60)
        if ready is not None:
            ready(node)
        targets = [f"127.0.0.1:{gw}", *([f"127.0.0.1:{wk}"] if worker else [])]
        prom = Prometheus(tmp_path, targets)
        prom.wait_for("sum(up)", len(targets))
        yield node, prom, gw, wk
    finally:
        if prom is not None:
            prom.stop()
        node.stop()


@pytest.fixture
def prometheus_bin() -> str:
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary on PATH (Debian: apt-get install prometheus)")
    return PROMETHEUS


async def test_prometheus_counts_exactly_the_requests_served(
    prometheus_bin: str, e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    with scraped(tmp_path, e2e_redis) as (node, prom, _gw, _wk):
        await generate(node.address, N)
        prom.wait_for('sum(llamamesh_requests_total{method="Generate",code="OK"})', N)
        prom.wait_for('sum(llamamesh_request_duration_seconds_count{method="Generate"})', N)
        prom.wait_for("sum(llamamesh_time_to_first_token_seconds_count)", N)
        prom.wait_for("sum(llamamesh_queue_wait_seconds_count)", N)
        prom.wait_for("sum(llamamesh_generation_tokens_total)", N * MAX_TOKENS)
        # a gap per streamed message after a request's first (a fast engine step may carry several tokens)
        itl = prom.query("sum(llamamesh_inter_token_latency_seconds_count)")
        assert itl is not None and 0 <= itl <= N * (MAX_TOKENS - 1)
        prom.wait_for('sum(llamamesh_jobs_finished_total{status="ok"})', N)
        prom.wait_for("sum(llamamesh_jobs_started_total)", N)
        prom.wait_for("sum(llamamesh_worker_generated_tokens_total)", N * MAX_TOKENS)
        prom.wait_for("sum(llamamesh_inflight_requests)", 0)
        prom.wait_for('llamamesh_breaker_state{pool="cpu"}', 0)
        prom.wait_for('llamamesh_workers{pool="cpu",state="ready"}', 1)
        prom.wait_for('llamamesh_queue_depth{pool="cpu"}', 0)
        prom.wait_for('llamamesh_engine_running_requests{pool="cpu"}', 0)


async def test_two_gateway_processes_give_one_scrape_of_both(
    prometheus_bin: str, e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    def both_listening(node: ProcessNode) -> None:
        wait_until(lambda: node.log("gateway").count('"gateway_started"') == 2, 30, "both gateways listening")

    with scraped(tmp_path, e2e_redis, worker=False, ready=both_listening, LLAMAMESH_GATEWAY_PROCESSES="2") as (
        node,
        prom,
        gw,
        _wk,
    ):
        # Channels with connections of their own: the kernel spreads them over both processes.
        await generate(node.address, 4 * N, channels=16)
        prom.wait_for('sum(llamamesh_requests_total{method="Generate",code="OK"})', 4 * N)
        prom.wait_for("sum(llamamesh_generation_tokens_total)", 4 * N * MAX_TOKENS)
        prom.wait_for("sum(llamamesh_time_to_first_token_seconds_count)", 4 * N)
        # Both processes served some of them, and the scrape holds both processes' counts.
        served = [line for line in node.log("gateway").splitlines() if '"rpc_finished"' in line and "Generate" in line]
        procs = {json.loads(line).get("process") for line in served}
        assert len(procs) == 2, procs
        text = metrics_text(gw)
        assert 'llamamesh_requests_total{code="OK",method="Generate",pool="cpu"}' in text


# Series a healthy node serving Generates has none of: nothing failed over, was dead-lettered, refused,
# moved a breaker or ran a batch item (these counters have a series only once one happened). Their
# expressions must still evaluate.
NO_DATA_WHEN_HEALTHY = {
    "llamamesh_failovers_total",
    "llamamesh_dead_letters_total",
    "llamamesh_admission_rejected_total",
    "llamamesh_breaker_transitions_total",
    "llamamesh_batch_items_total",
}


def dashboard_query(expr: str, pool: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$pool", pool)


def evaluate(prom: Prometheus) -> tuple[list[Any], list[str]]:
    """(the expressions Prometheus refused, with its answers; those without the series they should have)."""
    failed: list[Any] = []
    empty: list[str] = []
    for expr in dashboard_exprs():
        query = dashboard_query(expr, "cpu")
        answer = prom.answer(query)
        if answer.get("status") != "success":
            failed.append((query, answer))
        elif not answer["data"]["result"] and not metric_names(expr) <= NO_DATA_WHEN_HEALTHY:
            empty.append(query)
    for rule in alert_rules():
        answer = prom.answer(rule["expr"])
        if answer.get("status") != "success":
            failed.append((rule["alert"], answer))
        for name in metric_names(rule["expr"]) - NO_DATA_WHEN_HEALTHY:
            if prom.query(f'count({{__name__=~"{name}(_bucket)?"}})') is None:
                empty.append(f"{rule['alert']}: {name}")
    return failed, empty


async def test_every_dashboard_and_alert_expression_evaluates_against_a_real_node(
    prometheus_bin: str, e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    """Each PromQL expression of deploy/monitoring, run against the Prometheus that
    scraped a real node after it served requests: no error; the dashboard's return series (but for
    NO_DATA_WHEN_HEALTHY); the metrics the alerts read are there."""
    with scraped(tmp_path, e2e_redis) as (node, prom, _gw, _wk):
        await generate(node.address, N)
        prom.wait_for('sum(llamamesh_requests_total{method="Generate",code="OK"})', N)
        # rate() over RATE_INTERVAL needs two samples of each served count, from both scrapes: poll
        try:
            failed, empty = await until(
                lambda: evaluate(prom),
                30,
                "every expression to evaluate with series",
                done=lambda got: not got[0] and not got[1],
                poll_s=0.5,
            )
        except TimeoutError:
            failed, empty = evaluate(prom)  # the assertions below say which
        assert not failed, failed
        assert not empty, f"no series on a real node: {empty}"
