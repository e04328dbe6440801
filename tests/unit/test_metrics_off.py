"""Metrics off (port 0, in no multiprocess set) record nothing; on, they do. Each case runs in a
child process: turning metrics off rebinds llamamesh.metrics' names for the whole process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import sys
from prometheus_client import generate_latest
from llamamesh import metrics
from tests.redisproc import free_port
port = int(sys.argv[1]) and free_port()
metrics.serve(port, "127.0.0.1", "gateway")
metrics.REQUESTS.labels("Generate", "OK", "cpu").inc()
metrics.pool_recorder("cpu").itl.observe(0.01)
metrics.BREAKER_STATE.labels("cpu").set(2)
page = generate_latest().decode()
print(sum(1 for line in page.splitlines() if line.startswith(("llamamesh_requests_total{",
      "llamamesh_inter_token_latency_seconds_count{", "llamamesh_breaker_state{"))))
"""


@pytest.mark.parametrize(("port", "recorded"), [(0, 0), (1, 3)])
def test_metrics_off_record_nothing_and_on_record(port: int, recorded: int) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(port)], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) == recorded
