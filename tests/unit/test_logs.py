"""The processes' log configuration (llamamesh/logs.py), in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import logging
from grpc._cython import cygrpc
from llamamesh import logs
from llamamesh.settings import LogSettings

logs.configure(LogSettings(format="json"), "gateway")
core = logging.getLogger("grpc._cython.cygrpc")
for op in ("SendStatusFromServerOperation", "SendMessageOperation"):
    try:
        raise cygrpc.ExecuteBatchError(f'Failed "execute_batch": (<grpc._cython.cygrpc.{op} object at 0x1>,)')
    except cygrpc.ExecuteBatchError:
        core.exception("ExecuteBatchError raised in core by servicer method [/llamamesh.v1.GenerationService/Generate]")
"""


def test_a_status_too_late_for_its_ended_call_is_no_error_line_but_other_core_errors_are() -> None:
    """grpc.aio logs an error when a call's final status cannot go out because the call already
    ended (a deadline of a few ms): routine, and said by the call's own rpc_finished line."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert len(lines) == 1 and lines[0]["level"] == "error", lines
    assert "SendMessageOperation" in json.dumps(lines[0]), lines
