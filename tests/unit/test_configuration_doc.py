"""docs/configuration.md is rendered from the settings (llamamesh/settings/reference.py) and must
not drift from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamamesh.settings.environment import all_specs, sections
from llamamesh.settings.reference import COMMAND, descriptions, render

pytestmark = pytest.mark.timeout(30)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_page_is_what_the_settings_render() -> None:
    assert PAGE.read_text() == render(), f"docs/configuration.md differs from the settings; regenerate it: {COMMAND}"


def test_every_setting_is_described_and_listed() -> None:
    described = {f"{cls.section}.{name}" for cls in sections().values() for name in descriptions(cls)}
    assert {f"{s.section}.{s.name}" for s in all_specs()} <= described
    page = render()
    assert all(f"| `{s.env}` |" in page for s in all_specs())


def test_a_default_that_depends_on_the_machine_is_shown_as_written() -> None:
    page = render()
    assert "| `LLAMAMESH_WORKER_CACHE_DIR` | str | `~/.cache/llamamesh` |" in page
