"""The README's first command path: `llamamesh demo` starts embedded Valkey + gateway + CPU worker,
streams a real answer to the terminal, and stops everything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_demo_streams_a_real_answer_on_the_embedded_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMAMESH_")}
    env["LLAMAMESH_WORKER_THREADS"] = "1"
    env["LLAMAMESH_REDIS_EMBEDDED_DIR"] = str(tmp_path / "valkey")
    cli = Path(sys.executable).parent / "llamamesh"
    out = subprocess.run(
        [str(cli), "demo", "What is the capital of France?", "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout, (out.stdout, out.stderr[-3000:])
    assert "finish=" in out.stderr
    # the embedded server kept its append-only file where we asked
    assert any((tmp_path / "valkey").rglob("*.aof*")) or any((tmp_path / "valkey").rglob("appendonly*"))
