"""The embedded node as a user runs it (`llamamesh serve`, then `llamamesh generate`), observed: the
metrics endpoints it prints show the metric names after one generate, and with the standard
OTEL_EXPORTER_OTLP_ENDPOINT set its gateway and worker send one trace per request."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.test_serve import CLI, clean_env, serve_node
from tests.observe.test_tracing import Receiver, receiver
from tests.waiting import wait_until

__all__ = ["receiver"]  # the OTLP receiver fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GATEWAY_NAMES = (
    "llamamesh_requests_total",
    "llamamesh_time_to_first_token_seconds_bucket",
    "llamamesh_inter_token_latency_seconds_bucket",
    "llamamesh_request_duration_seconds_bucket",
    "llamamesh_queue_wait_seconds_bucket",
    "llamamesh_prompt_tokens_total",
    "llamamesh_generation_tokens_total",
    "llamamesh_inflight_requests",
    "llamamesh_queue_depth",
    "llamamesh_queue_pending",
    "llamamesh_breaker_state",
    "llamamesh_workers",
)
WORKER_NAMES = (
    "llamamesh_jobs_started_total",
    "llamamesh_jobs_finished_total",
    "llamamesh_worker_generated_tokens_total",
    "llamamesh_engine_running_requests",
    "llamamesh_engine_waiting_requests",
    "llamamesh_engine_kv_cache_usage_ratio",
    "llamamesh_engine_steps_total",
)


def page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_serve_prints_metrics_urls_that_show_the_names_and_traces_reach_otlp(
    receiver: tuple[Receiver, int], tmp_path: Path
) -> None:
    rec, port = receiver
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with serve_node(tmp_path, **otel) as served:
        urls = dict(re.findall(r"metrics \((\w+)\): (http://\S+/metrics)", served.text()))
        assert set(urls) == {"gateway", "workers"}, served.text()[-2000:]
        out = subprocess.run(
            [str(CLI), "generate", "--address", served.address, "--max-tokens", "4", "Hi"],
            env=clean_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr

        def missing() -> list[str]:  # the RPC's end and the worker's heartbeat update them
            gw, wk = page(urls["gateway"]), page(urls["workers"])
            return [n for n in GATEWAY_NAMES if n not in gw] + [n for n in WORKER_NAMES if n not in wk]

        wait_until(missing, 15, "every metric on its endpoint", done=lambda names: not names, poll_s=0.2)
        gw = page(urls["gateway"])
        assert 'llamamesh_requests_total{code="OK",method="Generate",pool="cpu"} 1.0' in gw, gw[:3000]

        def job_under_generate() -> bool:  # each process exports within its schedule delay
            gen = next((s for svc, s in rec.spans if (svc, s.name) == ("gateway", "Generate")), None)
            return gen is not None and any(
                (svc, s.name) == ("worker", "job") and s.trace_id == gen.trace_id for svc, s in rec.spans
            )

        try:
            wait_until(job_under_generate, 30, "the Generate span and its job's span", poll_s=0.1)
        except TimeoutError as exc:
            raise AssertionError(sorted({(svc, s.name) for svc, s in rec.spans})) from exc
