"""structlog, configured once per process: JSON when stderr is not a terminal.

Third-party stdlib loggers (grpc, redis, transformers) go through the same
renderer. Request-scoped fields (``request_id``, ``worker``) are bound with
``structlog.contextvars``.
"""

from __future__ import annotations

import logging
import sys

import structlog

from llamamesh.settings import LogSettings


def configure(settings: LogSettings, process: str) -> bool:
    """Configure structlog and the stdlib root logger for this process; True when lines are JSON."""
    use_json = settings.format == "json" or (settings.format == "auto" and not sys.stderr.isatty())
    named = logging.getLevelName(settings.level.upper())  # an int for known names (3.10 has no mapping API)
    level = named if isinstance(named, int) else logging.INFO
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (message and newline together): processes sharing a log file never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.INFO))
    core = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, LateStatus) for f in core.filters):
        core.addFilter(LateStatus())
    structlog.contextvars.bind_contextvars(process=settings.process or process)
    return use_json


class LateStatus(logging.Filter):
    """Drops grpc.aio's error line for a call whose final status could not be sent because the call
    had already ended (its deadline passed, or its caller left, as the status went out): the RPC's
    own ``rpc_finished`` line says how it ended, and an alert on error lines would fire for every
    caller with a short deadline."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        late = "SendStatusFromServer" in repr(exc)
        return not (late and record.getMessage().startswith("ExecuteBatchError raised in core"))
