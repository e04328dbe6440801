"""The checked-in generated code is exactly what `make proto` produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_generated_code_matches_the_proto_files(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    checked_in = sorted(
        p.relative_to(ROOT) for p in (ROOT / "llamamesh").rglob("*_pb2*") if p.suffix in (".py", ".pyi")
    )
    assert generated == checked_in, "generated files differ from the checked-in ones: run `make proto`"
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} drifted: run `make proto`"


def test_every_public_proto_names_its_package_for_other_languages() -> None:
    """Clients in other languages compile proto/ themselves: protoc-gen-go refuses a file without
    go_package, so each public file names the same one."""
    from llamamesh.v1 import admin_pb2, batch_pb2, generation_pb2

    files = {m.DESCRIPTOR.name: m.DESCRIPTOR.GetOptions().go_package for m in (admin_pb2, batch_pb2, generation_pb2)}
    public = {str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto" / "llamamesh" / "v1").glob("*.proto")}
    assert set(files) == public
    assert len(set(files.values())) == 1 and all(files.values()), files
