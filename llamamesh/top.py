"""Moved to ``llamamesh.cli.top``: this old path re-exports it with a DeprecationWarning."""

import warnings

from llamamesh.cli.top import POOL_COLUMNS, WORKER_COLUMNS, pool_row, render, worker_row

__all__ = ["POOL_COLUMNS", "WORKER_COLUMNS", "pool_row", "render", "worker_row"]

warnings.warn("llamamesh.top moved to llamamesh.cli.top", DeprecationWarning, stacklevel=2)
