"""Moved to ``llamamesh.cli.node``: this old path re-exports it with a DeprecationWarning."""

import warnings

from llamamesh.cli.node import NOTE, Node, StartFailed, WorkerView

__all__ = ["NOTE", "Node", "StartFailed", "WorkerView"]

warnings.warn("llamamesh.node moved to llamamesh.cli.node", DeprecationWarning, stacklevel=2)
