"""The arrows go one way: services -> llamamesh <- workers. Checked on the import statements, and
transitively: what a module imports, what those import, and so on through llamamesh, services and
workers (a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
import functools
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
            if p.parent.name == "settings" or p.name in ("supervisor.py", "replicas.py", "frontends.py"):
                # The settings package is the one reader. The supervisor passes the environment on to
                # child processes, never reads settings from it; replicas reads CUDA's
                # CUDA_VISIBLE_DEVICES; frontends gives the processes vLLM spawns prometheus_client's
                # PROMETHEUS_MULTIPROC_DIR.
                continue
            assert "os.environ" not in p.read_text() and "os.getenv" not in p.read_text(), p


def test_every_redis_key_is_built_in_keys_py() -> None:
    for p in files("llamamesh") + files("services") + files("workers"):
        if p.name == "keys.py":
            continue
        text = p.read_text()
        assert ":pool:" not in text and ":req:" not in text, p


# --- transitive: a module reaches everything its imports reach

OURS = ("llamamesh", "services", "workers")
# The gateway process's composition root: it builds the Redis queue it hands to start_gateway.
COMPOSITION_ROOTS = {"services.server", "services.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(mod: str) -> Path | None:
    base = ROOT.joinpath(*mod.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


@functools.cache
def direct_imports(mod: str) -> frozenset[str]:
    """The modules ``mod`` imports (relative imports resolved, ``from pkg import module`` as the
    module), with the packages whose ``__init__`` importing them runs."""
    path = module_path(mod)
    if path is None:
        return frozenset()
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if module_path(f"{base}.{a.name}") is not None)
    return frozenset(out | {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)})


def reached(mod: str) -> dict[str, str]:
    """Every module ``mod`` reaches -> the module that imports it (to show the path)."""
    seen, todo = {mod: ""}, [mod]
    while todo:
        for n in direct_imports(m := todo.pop()):
            if n not in seen:
                seen[n] = m
                if n.split(".")[0] in OURS:
                    todo.append(n)
    return seen


def path_to(seen: dict[str, str], target: str) -> str:
    chain = [target]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


def forbidden(mods: list[str], banned: tuple[str, ...]) -> list[str]:
    out = []
    for m in mods:
        seen = reached(m)
        hit = next((t for t in seen if any(t == b or t.startswith(b + ".") for b in banned)), None)
        if hit is not None:
            out.append(path_to(seen, hit))
    return out


def test_services_never_reach_redis_even_through_the_core() -> None:
    mods = [module_name(p) for p in files("services")]
    assert forbidden([m for m in mods if m not in COMPOSITION_ROOTS], ("redis",)) == []


def test_engine_adapters_never_reach_redis_grpc_or_the_queue() -> None:
    mods = [module_name(p) for p in files("workers/engines")]
    assert forbidden(mods, ("redis", "grpc", "llamamesh.queue", "services")) == []


def test_workers_never_reach_grpc_or_the_gateway() -> None:
    mods = [module_name(p) for p in files("workers")]
    assert forbidden(mods, ("grpc", "services", "llamamesh.client", "llamamesh.cli")) == []


def test_the_queue_protocols_and_fakes_need_no_redis() -> None:
    mods = ["llamamesh.queue.protocol", "llamamesh.queue.keys", "llamamesh.queue.codec", "llamamesh.queue.memory"]
    assert forbidden(mods, ("redis",)) == []
