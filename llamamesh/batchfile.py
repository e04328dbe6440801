"""Moved to ``llamamesh.cli.batchfile``: this old path re-exports it with a DeprecationWarning."""

import warnings

from llamamesh.cli.batchfile import batch_json, items, read_lines, result_line, summarise_request

__all__ = ["batch_json", "items", "read_lines", "result_line", "summarise_request"]

warnings.warn("llamamesh.batchfile moved to llamamesh.cli.batchfile", DeprecationWarning, stacklevel=2)
