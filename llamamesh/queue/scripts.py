"""The queue's Lua scripts: one file each in ``lua/``, read once, registered on a client.

A file opens with comment lines that document it (its KEYS, ARGV and reply), which are not sent to
Redis; a ``--! include <name>`` line is replaced by that file's script (a shared Lua function).
"""

from __future__ import annotations

import functools
import re
from importlib.resources import files

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

_INCLUDE = re.compile(r"^--! include (\w+)$", re.MULTILINE)


@functools.cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua`` as Redis runs it: its leading comments dropped, its includes
    filled in. Raises FileNotFoundError for a name with no file."""
    text = (files("llamamesh.queue") / "lua" / f"{name}.lua").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("--") and not _INCLUDE.match(lines[0].rstrip("\n")):
        lines.pop(0)
    return _INCLUDE.sub(lambda m: source(m.group(1)).rstrip("\n"), "".join(lines))


def register(client: aioredis.Redis, name: str) -> AsyncScript:
    """``lua/<name>.lua`` registered on ``client`` (run by EVALSHA, loaded again on NOSCRIPT)."""
    script: AsyncScript = client.register_script(source(name))
    return script
