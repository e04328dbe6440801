"""``llamamesh config``: the effective configuration, one ``LLAMAMESH_NAME=value`` per line, secrets
redacted."""

from __future__ import annotations

import argparse

from llamamesh.cli import flags
from llamamesh.settings import adapter_table


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="print the effective configuration (secrets redacted)")
    # serve's flags, so that `llamamesh config --port ...` shows what `llamamesh serve --port ...` runs with
    flags.gateway_flags(p)
    flags.redis_flags(p)
    flags.worker_flags(p)
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    """Every setting from the environment (and the flags), sorted by name; a setting whose text has a
    form of its own (the model, fallback and adapter tables) that does not parse stops it, naming it,
    as it would stop the process that reads it."""
    settings = flags.settings(args)
    try:
        settings.gateway.model_table()
        settings.gateway.fallback_table()
        adapter_table(settings.worker.adapters)
    except ValueError as exc:
        raise flags.BadSetting(str(exc)) from exc
    for name, value in sorted(settings.redacted_env().items()):
        print(f"{name}={value}")
    return 0
