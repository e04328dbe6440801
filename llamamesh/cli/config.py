"""``llamamesh config``: the effective configuration, one ``LLAMAMESH_NAME=value`` per line, secrets
redacted."""

from __future__ import annotations

import argparse

from llamamesh.cli import flags


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="print the effective configuration (secrets redacted)")
    # serve's flags, so that `llamamesh config --port ...` shows what `llamamesh serve --port ...` runs with
    flags.gateway_flags(p)
    flags.redis_flags(p)
    flags.worker_flags(p)
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    """Every setting from the environment (and the flags), sorted by name."""
    for name, value in sorted(flags.settings(args).redacted_env().items()):
        print(f"{name}={value}")
    return 0
