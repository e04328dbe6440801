"""``llamamesh serve | demo | gateway | worker``: run a whole node, a node for one answer, or one of a
node's processes."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import structlog

from llamamesh import logs
from llamamesh.cli import flags
from llamamesh.cli.generate import stream_answer
from llamamesh.cli.node import Node, StartFailed
from llamamesh.ports import free_port
from llamamesh.settings import is_set

# A node that never served has nothing to drain: its processes get this long after SIGTERM (a worker
# converting a model ignores it until killed).
START_FAILED_STOP_S = 3.0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run a whole node")
    flags.node_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="start a node, stream one answer, stop")
    flags.node_flags(p)
    flags.generation_flags(p)
    p.set_defaults(func=cmd_demo)

    # One process of a node (what Kubernetes runs): each takes only its own flags.
    p = sub.add_parser("gateway", help="run only the gateway process")
    flags.gateway_flags(p)
    flags.redis_flags(p, embedded=False)
    p.set_defaults(func=lambda a: become("services", a))

    p = sub.add_parser("worker", help="run only the worker process")
    flags.redis_flags(p, embedded=False)
    flags.worker_flags(p)
    p.set_defaults(func=lambda a: become("workers", a))


def cmd_serve(args: argparse.Namespace) -> int:
    settings = flags.settings(args)
    # With JSON logs (stderr not a terminal, or LLAMAMESH_LOG_FORMAT=json) the node's progress is log
    # events like its processes' lines; the one `error:` line of a node that cannot start stays text.
    events = logs.configure(settings.log, "node")
    say = _say(events)
    node = Node(settings, workers=args.workers)
    served = False
    try:
        node.start()
        say("node_starting", f"llamamesh starting on {node.address} with {args.workers} worker(s) ...")
        took = asyncio.run(node.wait_ready(sys.stderr, events=events))
        say("node_serving", f"llamamesh serving on {node.address} (ready in {took:.1f} s; Ctrl-C stops)")
        served = True
        return node.wait()
    except (StartFailed, OSError) as exc:
        # One error line: where the process that ended wrote its own, the node only adds what it does.
        print(f"the node stops: {exc}" if getattr(exc, "said", False) else f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if served:
            node.stop()
        else:
            node.stop(START_FAILED_STOP_S)


def _say(events: bool) -> Callable[[str, str], None]:
    """A line for the operator: a log event named ``event`` with JSON logs, else the text on stderr."""
    if events:
        log = structlog.get_logger("llamamesh.serve")
        return lambda event, text: log.info(event, message=text)
    return lambda _event, text: print(text, file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    settings = flags.settings(args)
    if args.port is None and not is_set("gateway", "port"):
        settings = settings.with_overrides(gateway={"port": free_port()})  # never collides with a running node
    logs.configure(replace(settings.log, level="warning", format="console"), "demo")
    fd, name = tempfile.mkstemp(prefix="llamamesh-demo-", suffix=".log")  # this run's own: any user's
    os.close(fd)
    log_file = Path(name)
    node = Node(settings, workers=1, log_file=log_file)
    t0 = time.monotonic()
    print(f"starting a node on {settings.gateway.host}:{settings.gateway.port} (logs: {log_file})", file=sys.stderr)
    try:
        node.start()
        asyncio.run(node.wait_ready(sys.stderr))
        print(f"> {args.prompt}\n", file=sys.stderr)
        args.tls = bool(settings.gateway.tls_cert)  # the node's gateway speaks TLS: so does the demo's client
        code = asyncio.run(stream_answer(node.address, args, wait_s=0))
        print(f"[demo done in {time.monotonic() - t0:.1f} s]", file=sys.stderr)
        return code
    except (StartFailed, OSError) as exc:
        print(f"error: {exc} (logs: {log_file})", file=sys.stderr)
        node.stop(START_FAILED_STOP_S)
        return 1
    finally:
        node.stop()


def become(module: str, args: argparse.Namespace) -> int:
    """Replace this process with ``python -m module`` (the gateway or a worker), the command's
    settings in its environment."""
    for name, value in flags.settings(args).to_env().items():
        # putenv: the exec'd process inherits this process's environment with the settings over
        # it, and nothing here reads the environment.
        os.putenv(name, value)
    os.execv(sys.executable, [sys.executable, "-m", module])
    return 1  # not reached
