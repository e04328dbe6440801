"""One worker process per GPU group: which groups, and the supervisor with real worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from llamamesh.errors import InvalidRequest
from llamamesh.queue.keys import Keys
from llamamesh.settings import RedisSettings, Settings
from tests.waiting import wait_until
from workers.engines.registry import ENGINES
from workers.replicas import replica_gpus, replica_groups, visible_gpus

pytestmark = pytest.mark.timeout(60)


def test_visible_gpus_come_from_cuda_visible_devices_else_nvidia_smi(tmp_path: Path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # hidden on purpose: no GPU
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(0o755)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{tmp_path}:{old}"
    try:
        assert visible_gpus({}) == ["0", "1"]
    finally:
        os.environ["PATH"] = old


def test_replica_groups() -> None:
    assert replica_gpus(["0", "1"], 0, "f") == []  # default: one worker spans every GPU
    assert replica_gpus(["0", "1"], 2, "f") == []
    assert replica_gpus(["0"], 1, "f") == []
    assert replica_gpus(["0", "1"], 1, "f") == [["0"], ["1"]]  # TP 1: one worker per GPU
    assert replica_gpus(["4", "5", "6", "7"], 2, "f") == [["4", "5"], ["6", "7"]]
    with pytest.raises(InvalidRequest) as exc:
        replica_gpus(["0", "1", "2"], 2, "vllm.tensor_parallel_size")
    assert exc.value.violations[0].field == "vllm.tensor_parallel_size"


def test_the_engine_setting_decides_how_many_gpus_a_replica_takes() -> None:
    vllm = Settings.from_env({"LLAMAMESH_WORKER_ENGINE": "vllm", "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE": "1"})
    assert replica_groups(vllm, ENGINES["vllm"], ["0", "1"]) == [["0"], ["1"]]
    trt = Settings.from_env({"LLAMAMESH_WORKER_ENGINE": "trtllm", "LLAMAMESH_TRTLLM_TENSOR_PARALLEL_SIZE": "2"})
    assert replica_groups(trt, ENGINES["trtllm"], ["0", "1", "2", "3"]) == [["0", "1"], ["2", "3"]]
    with pytest.raises(InvalidRequest) as exc:
        replica_groups(trt, ENGINES["trtllm"], ["0", "1", "2"])
    assert exc.value.violations[0].field == "trtllm.tensor_parallel_size"
    cpu = Settings.from_env({"LLAMAMESH_WORKER_ENGINE": "transformers"})
    assert replica_groups(cpu, ENGINES["transformers"], ["0", "1"]) == []


SUPERVISE = """
import os, sys
from llamamesh import logs
from llamamesh.settings import Settings
from workers.replicas import run_replicas
s = Settings.from_env()
logs.configure(s.log, "worker")
sys.exit(run_replicas(s, [["0"], ["1"]]))
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(x) for x in out.split()]


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def _replica(pid: int) -> bool:
    """True once the child has exec'd: between fork and exec it still shows the supervisor's environment."""
    try:
        return _env_of(pid).get("LLAMAMESH_WORKER_CONSUMER", "node-a") != "node-a"
    except OSError:
        return False


@pytest.mark.redis
@pytest.mark.parametrize("stop", ["sigterm", "a replica dies"])
def test_the_supervisor_runs_one_worker_per_group_restarts_a_dead_one_and_stops_them_together(
    redis_settings: RedisSettings, stop: str
) -> None:
    env = {
        **os.environ,
        "LLAMAMESH_REDIS_URL": redis_settings.url,
        "LLAMAMESH_REDIS_PREFIX": redis_settings.prefix,
        "LLAMAMESH_WORKER_ENGINE": "fake",
        "LLAMAMESH_WORKER_POOL": "gpu",
        "LLAMAMESH_WORKER_CONSUMER": "node-a",
        "LLAMAMESH_WORKER_HEARTBEAT_S": "0.2",
    }
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE], env=env)
    r = redis.Redis.from_url(redis_settings.url)
    keys = Keys(redis_settings.prefix)
    try:
        names = ("node-a-r0", "node-a-r1")
        wait_until(lambda: all(r.exists(keys.worker("gpu", n)) for n in names), 30, "both replicas' heartbeats")
        kids = _children(sup.pid)
        assert sorted(_env_of(k)["CUDA_VISIBLE_DEVICES"] for k in kids) == ["0", "1"]
        assert sorted(_env_of(k)["LLAMAMESH_WORKER_CONSUMER"] for k in kids) == list(names)
        if stop == "a replica dies":  # it is started again, with its own GPU and name; the other goes on
            dead = next(k for k in kids if _env_of(k)["CUDA_VISIBLE_DEVICES"] == "0")
            os.kill(dead, signal.SIGKILL)
            wait_until(
                lambda: (now := _children(sup.pid)) and len(now) == 2 and dead not in now and all(map(_replica, now)),
                30,
                "a new replica 0",
            )
            again = [k for k in _children(sup.pid) if k not in kids]
            assert [_env_of(k)["CUDA_VISIBLE_DEVICES"] for k in again] == ["0"]
            assert [_env_of(k)["LLAMAMESH_WORKER_CONSUMER"] for k in again] == ["node-a-r0"]
            kids = _children(sup.pid)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0
        assert all(not Path(f"/proc/{k}").exists() or _env_of(k) == {} for k in kids)
    finally:
        if sup.poll() is None:
            left = _children(sup.pid)
            sup.kill()
            sup.wait()
            for k in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)
        r.close()
