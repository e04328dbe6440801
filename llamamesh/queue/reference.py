"""The table of every Redis key llamamesh writes, rendered from ``Keys`` (each key's docstring) and
``Retention``, for docs/architecture.md (between its ``keys`` markers). tests/unit/test_keys_doc.py
fails when the page and the code differ. Rewrite the page's table with

    .venv/bin/python -m llamamesh.queue.reference docs/architecture.md
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

from llamamesh.queue.keys import Keys, Retention

COMMAND = ".venv/bin/python -m llamamesh.queue.reference docs/architecture.md"
BEGIN = f"<!-- keys: rendered from llamamesh/queue/keys.py by `{COMMAND}` -->"
END = "<!-- /keys -->"
# What each parameter of a key method stands for in the table.
PLACEHOLDERS = {
    "pool": "<pool>",
    "tenant": "<tenant>",
    "request_id": "<id>",
    "caller_id": "<id>",
    "batch_id": "<batch>",
    "owner": "<owner>",
    "file_id": "<file>",
    "name": "<worker>",
    "partition": "<k>",
    "follower_id": "<gateway>",
    "tag": "",
}
# Keys named through another method (the table lists each key once).
ALIASES = {"work"}


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def key_rows(keys: Keys | None = None) -> list[tuple[str, str]]:
    """(key pattern, what it holds) for each key method of ``Keys``, in the order of its source."""
    keys = keys or Keys()
    rows = []
    for name, fn in vars(Keys).items():
        if name.startswith("_") or name in ALIASES or not inspect.isfunction(fn):
            continue
        params = list(inspect.signature(fn).parameters)[1:]
        key = fn(keys, *(PLACEHOLDERS[p] for p in params))
        if name == "events":  # its slot is a computed shard tag
            key = f"{keys.prefix}:ev:{{<shard>}}:<id>"
        rows.append((key.replace(keys.prefix, "…", 1), _one_line(fn.__doc__ or "")))
    return rows


def retention_rows() -> list[tuple[str, str, str]]:
    """(Retention field, its default, the comment above it in the source) for each field."""
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(Retention).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# "))
        elif ":" in text and not text.startswith(("@", "class", '"')):
            comments.setdefault(text.split(":")[0], " ".join(above))
            above = []
    return [(f.name, str(f.default), _one_line(comments.get(f.name, ""))) for f in dataclasses.fields(Retention)]


def render() -> str:
    lines = [BEGIN, "", f"Every key starts with the prefix (`LLAMAMESH_REDIS_PREFIX`, default `{Keys().prefix}`).", ""]
    lines += ["| key | what it holds, who writes and reads it |", "| --- | --- |"]
    lines += [f"| `{key}` | {what} |" for key, what in key_rows()]
    lines += ["", "How long things live (`Retention`, from the settings; defaults):", ""]
    lines += ["| retention | default | what |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {value} | {what} |" for name, value, what in retention_rows()]
    return "\n".join([*lines, "", END])


def spliced(page: str) -> str:
    """``page`` with the text between its markers replaced by ``render()`` (ValueError without them)."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN!r} ... {END!r} block")
    return page[:start] + render() + page[end + len(END) :]


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit(f"usage: {COMMAND}")
    path = Path(argv[0])
    path.write_text(spliced(path.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
