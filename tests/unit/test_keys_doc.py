"""docs/architecture.md's table of Redis keys is rendered from llamamesh/queue/keys.py
(llamamesh/queue/reference.py) and must not drift from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamamesh.queue.keys import Keys
from llamamesh.queue.reference import COMMAND, key_rows, spliced

pytestmark = pytest.mark.timeout(30)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_page_holds_the_table_the_keys_render() -> None:
    page = PAGE.read_text()
    assert spliced(page) == page, f"docs/architecture.md's key table differs from keys.py; regenerate it: {COMMAND}"


def test_every_key_is_listed_and_described() -> None:
    rows = key_rows(Keys(prefix="p"))
    assert len(rows) == len({key for key, _ in rows}) >= 30
    assert all(what for _key, what in rows), [key for key, what in rows if not what]
