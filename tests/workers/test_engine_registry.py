"""The engine registry (workers/engines/registry.py): every engine described once, the process mode
``python -m workers`` picks from it, and no other worker module naming an engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llamamesh.errors import InvalidRequest
from llamamesh.settings import Settings
from workers import __main__ as entry
from workers.engines.registry import ENGINES, ProcessMode, spec_of

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


def settings(**env: str) -> Settings:
    return Settings.from_env({f"LLAMAMESH_{k.upper()}": v for k, v in env.items()})


def no_gpus_asked() -> list[str]:
    raise AssertionError("an engine that spans no GPUs asked for them")


def test_every_entry_names_its_settings_section_and_its_class() -> None:
    s = Settings()
    for name, spec in ENGINES.items():
        assert spec.name == name
        if spec.section:
            assert isinstance(getattr(s, spec.section), spec.settings_class), name
        else:
            assert spec.settings_class is None and not spec.devices_field and not spec.frontends_field, name
    with pytest.raises(InvalidRequest) as exc:
        spec_of("nope")
    assert exc.value.violations[0].field == "worker.engine"


def test_the_process_mode_comes_from_the_entry_and_the_settings() -> None:
    two = ["0", "1"]
    vllm, trt, cpu = ENGINES["vllm"], ENGINES["trtllm"], ENGINES["transformers"]
    assert vllm.process_mode(settings(worker_engine="vllm"), lambda: two) is ProcessMode.ONE_PROCESS
    tp1 = settings(worker_engine="vllm", vllm_tensor_parallel_size="1", vllm_frontends="4")
    assert vllm.process_mode(tp1, lambda: two) is ProcessMode.REPLICAS  # replicas first, each with frontends
    assert vllm.process_mode(tp1, lambda: ["0"]) is ProcessMode.FRONTENDS
    assert vllm.frontends(tp1) == 4 and trt.frontends(tp1) == 1
    trt2 = settings(worker_engine="trtllm", trtllm_tensor_parallel_size="2")
    assert trt.process_mode(trt2, lambda: two) is ProcessMode.ONE_PROCESS
    assert trt.process_mode(trt2, lambda: ["0", "1", "2", "3"]) is ProcessMode.REPLICAS
    assert trt.devices_setting == "trtllm.tensor_parallel_size"
    assert cpu.process_mode(settings(), no_gpus_asked) is ProcessMode.ONE_PROCESS


def test_the_worker_command_runs_the_mode_it_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, object]] = []

    def serve(s: Settings) -> str:
        return "serve"

    monkeypatch.setattr(entry, "serve", serve)
    monkeypatch.setattr(entry, "run_main", lambda what: ran.append(("one_process", what)) or 0)
    monkeypatch.setattr(entry, "run_frontends", lambda s, spec: ran.append(("frontends", spec.name)) or 0)
    monkeypatch.setattr(entry, "run_replicas", lambda s, groups: ran.append(("replicas", groups)) or 0)
    monkeypatch.setattr(entry, "visible", lambda: ["0", "1"])
    entry.run(settings(worker_engine="vllm", vllm_tensor_parallel_size="1"))
    entry.run(settings(worker_engine="vllm", vllm_frontends="2"))
    entry.run(settings(worker_engine="trtllm"))
    entry.run(settings(worker_engine="nope"))  # the worker reports it, as one process
    assert ran == [
        ("replicas", [["0"], ["1"]]),
        ("frontends", "vllm"),
        ("one_process", "serve"),
        ("one_process", "serve"),
    ]


def test_no_other_worker_module_compares_engine_names() -> None:
    names = set(ENGINES)
    for p in (ROOT / "workers").rglob("*.py"):
        if p.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                assert not names & set(consts), (p, ast.unparse(node))
