"""The arrows go one way: services -> llamamesh <- workers. Checked on the import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(30)


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def files(pkg: str) -> list[Path]:
    return [p for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]


def top(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def test_core_imports_neither_side() -> None:
    for p in files("llamamesh"):
        assert not top(imports(p)) & {"services", "workers"}, p


def test_services_never_import_workers_engines_or_redis() -> None:
    for p in files("services"):
        bad = top(imports(p)) & {"workers", "redis", "torch", "transformers", "vllm", "tensorrt_llm"}
        assert not bad, (p, bad)


def test_workers_never_import_services_or_grpc() -> None:
    for p in files("workers"):
        mods = imports(p)
        bad = top(mods) & {"services", "grpc", "grpc_health", "grpc_reflection"}
        assert not bad, (p, bad)
        assert "llamamesh.client" not in mods and "llamamesh.v1" not in mods, p


def test_engine_adapters_never_import_redis_or_grpc_or_the_queue() -> None:
    for p in files("workers/engines"):
        mods = imports(p)
        assert not top(mods) & {"redis", "grpc"}, p
        assert not any(m.startswith("llamamesh.queue") for m in mods), p


def test_engine_libraries_only_in_their_adapter() -> None:
    owners = {"vllm": "vllm", "tensorrt_llm": "trtllm", "torch": None, "transformers": None}
    for pkg in ("llamamesh", "services", "workers"):
        for p in files(pkg):
            for lib in top(imports(p)) & set(owners):
                if owners[lib] is None:
                    assert p.parent.name == "engines", (p, lib)
                else:
                    assert p.parent.name == "engines" and p.stem.split("_")[0] == owners[lib], (p, lib)


def test_only_settings_reads_the_environment() -> None:
    for pkg in ("llamamesh", "services", "workers"):
        for p in files(pkg):
            if p.name in ("settings.py", "cli.py", "supervisor.py", "replicas.py", "frontends.py"):
                # cli/supervisor pass the environment on to child processes, never read settings
                # from it (replicas reads CUDA's CUDA_VISIBLE_DEVICES; frontends gives the processes
                # vLLM spawns prometheus_client's PROMETHEUS_MULTIPROC_DIR)
                continue
            assert "os.environ" not in p.read_text() and "os.getenv" not in p.read_text(), p


def test_every_redis_key_is_built_in_keys_py() -> None:
    for p in files("llamamesh") + files("services") + files("workers"):
        if p.name == "keys.py":
            continue
        text = p.read_text()
        assert ':pool:' not in text and ':req:' not in text, p
