"""Moved to ``llamamesh.cli.embedded``: this old path re-exports it with a DeprecationWarning."""

import warnings

from llamamesh.cli.embedded import EmbeddedRedis

__all__ = ["EmbeddedRedis"]

warnings.warn("llamamesh.embedded moved to llamamesh.cli.embedded", DeprecationWarning, stacklevel=2)
