"""Moved to ``llamamesh.client.resume``: this old path re-exports it with a DeprecationWarning."""

import warnings

from llamamesh.client.resume import CANCEL_TIMEOUT_S, RESUMED_REASONS, Resumption, resumed, resumed_sync, worth_resuming
from llamamesh.client.status import error_reason

__all__ = [
    "CANCEL_TIMEOUT_S",
    "RESUMED_REASONS",
    "Resumption",
    "error_reason",
    "resumed",
    "resumed_sync",
    "worth_resuming",
]

warnings.warn("llamamesh.resume moved to llamamesh.client.resume", DeprecationWarning, stacklevel=2)
