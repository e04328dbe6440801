"""How each process logs (llamamesh/logs.py configures it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamamesh.settings.schema import Section


@dataclass(frozen=True)
class LogSettings(Section, section="log"):
    """How each process logs."""

    level: str = "info"
    """The lowest level logged: debug, info, warning or error, in any case (a name it does not know: info)."""

    format: Literal["auto", "json", "console"] = "auto"
    """auto: JSON unless stderr is a terminal; json; console (plain text)."""

    process: str = ""
    """The name this process logs under (the "process" field). Empty: its role (gateway, worker, ...)."""
