"""The code stays readable at a glance: no module of the product over 400 lines, no function or
method over 60 (generated protobuf code aside). Split along what each part owns (STYLE.md §1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
pytestmark = pytest.mark.timeout(30)


def product_files() -> list[Path]:
    return sorted(
        p for pkg in ("llamamesh", "services", "workers") for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name
    )


def test_no_module_is_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in product_files() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_limit() -> None:
    long = {}
    for p in product_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
