"""The ``llamamesh`` command.

llamamesh serve                 a whole node: embedded Valkey (unless LLAMAMESH_REDIS_URL), gateway, CPU worker
llamamesh gateway | worker      one process of a node (what Kubernetes runs)
llamamesh generate "..."        stream an answer to the terminal
llamamesh demo "..."            start a node, stream one answer, stop
llamamesh models | tokenize     the models served; a prompt's token ids
llamamesh top [--once]          each pool: workers, requests in flight / slots, queue, tokens/s (AdminService)
llamamesh batch submit FILE.jsonl [--summarise]   submit a durable batch, show its progress
llamamesh batch status | results | cancel | list  follow it (JSONL formats: llamamesh/cli/batchfile.py)
llamamesh auth create-key TENANT [--admin] | revoke-key KEY_ID | list-keys   the tenants file
llamamesh config                the effective configuration, secrets redacted
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

import grpc

from llamamesh.cli import auth, batch, config, flags, generate, models, serve, top
from llamamesh.cli.flags import BadSetting

# Each command module adds its own subcommands, in the order `llamamesh --help` lists them.
COMMANDS = (serve, generate, models, top, batch, auth, config)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llamamesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"llamamesh {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    """Run the command ``argv`` (default: the process's arguments) and exit with its code; a bad
    setting exits 1 with one line naming it."""
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is caught, not at exit
    # (TimeoutError: --wait for a gateway that is not up; ValueError: flags that do not go together)
    except (BadSetting, TimeoutError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except grpc.RpcError as exc:  # a call the gateway refused or could not be reached for
        print(flags.rpc_error(exc), file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # the reader went away (| head): quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit)
        sys.exit(141)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code)


def _version() -> str:
    """The installed package's version."""
    try:
        return metadata.version("llamamesh")
    except metadata.PackageNotFoundError:  # a checkout run without installing it
        return "unknown"
