"""``llamamesh top``: a gateway's pools (AdminService.ListBackends) as text, redrawn until Ctrl-C.

``render`` is a pure function of the response, so that a test can render a hand-built one; the
command fetches, renders and redraws.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

import grpc

from llamamesh.cli import flags
from llamamesh.v1 import admin_pb2 as pb

POOL_COLUMNS = (
    "POOL",
    "BREAKER",
    "SERVING",
    "READY",
    "STARTING",
    "FAILED",
    "INFLIGHT/SLOTS",
    "QUEUED",
    "LEASED",
    "WAIT",
    "TOK/S",
    "FALLBACK",
)
WORKER_COLUMNS = ("  WORKER", "STATE", "ENGINE", "MODEL", "INFLIGHT/SLOTS", "RUNNING", "WAITING", "KV", "DETAIL")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns two spaces apart (the last one not padded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1]).rstrip() for r in rows]


def _optional(b: pb.Backend, name: str) -> str:
    return str(getattr(b, name)) if b.HasField(name) else "?"


def pool_row(b: pb.Backend) -> list[str]:
    states = Counter(w.state for w in b.workers)
    inflight = sum(w.inflight for w in b.workers)
    slots = sum(w.max_inflight for w in b.workers if w.state == "ready")
    return [
        b.pool,
        b.breaker_state,
        "yes" if b.serving else "no",
        str(states["ready"]),
        str(states["starting"]),
        str(states["failed"]),
        f"{inflight}/{slots}",
        _optional(b, "queue_depth"),
        _optional(b, "queue_pending"),
        f"{b.queue_wait_s:.2f}s",
        f"{b.tokens_per_s:.1f}",
        b.fallback or "-",
    ]


def worker_row(w: pb.Worker) -> list[str]:
    return [
        f"  {w.name}",
        w.state,
        w.engine,
        w.model or "-",
        f"{w.inflight}/{w.max_inflight}",
        str(w.running),
        str(w.waiting),
        f"{w.kv_cache_usage:.0%}",
        w.detail,
    ]


def render(resp: pb.ListBackendsResponse, title: str = "") -> str:
    """One frame: a line per pool (workers by state; requests in flight over the ready workers'
    slots; jobs queued unleased and leased; recent queue wait; tokens per second), then its workers
    and, when it is not closed or its probe failed, why."""
    lines = [title] if title else []
    if not resp.backends:
        return "\n".join([*lines, "no backend pools"]) + "\n"
    lines += _table([POOL_COLUMNS, *(pool_row(b) for b in resp.backends)])
    for b in resp.backends:
        lines.append("")
        notes = []
        if b.breaker_state != "closed" and b.transitions:
            t = b.transitions[-1]
            notes.append(f"breaker {t.from_state} -> {t.to_state}: {t.reason}")
        if b.last_probe_error:
            notes.append(f"last probe: {b.last_probe_error}")
        lines.append(f"{b.pool}: {len(b.workers)} worker(s)" + (f"; {'; '.join(notes)}" if notes else ""))
        if b.workers:
            lines += _table([WORKER_COLUMNS, *(worker_row(w) for w in b.workers)])
    return "\n".join(lines).rstrip() + "\n"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("top", help="each pool's workers, requests in flight, queue and tokens/s, refreshed")
    p.add_argument(
        "--interval", type=flags.at_least(0.1, float), default=1.0, help="seconds between frames (default 1)"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    flags.client_flags(p)
    p.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    """Frames until Ctrl-C (which ends it with 0), or one with --once."""
    try:
        return asyncio.run(_top(args, sys.stdout))
    except KeyboardInterrupt:
        return 0


async def _top(args: argparse.Namespace, out: TextIO) -> int:
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""  # home and clear; a pipe gets plain frames
    # Ctrl-C sets ``stop`` and cancels the call in flight, rather than asyncio.run cancelling this
    # task: a task cancel that lands as grpc.aio's unary call completes is lost (its inner task
    # swallows the CancelledError; the await returns, or raises an AioRpcError with status OK), and
    # top would go on redrawing.
    stop = asyncio.Event()
    calls: list[Any] = []  # the ListBackends in flight

    def interrupt() -> None:
        stop.set()
        for call in calls:
            call.cancel()

    with contextlib.suppress(NotImplementedError):  # Windows: asyncio.run's cancel
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupt)  # the loop's close removes it
    async with flags.client(args.address, args) as c:
        while not stop.is_set():
            title = f"llamamesh top  {args.address}  {time.strftime('%H:%M:%S')}"
            calls[:] = [c.admin.ListBackends(pb.ListBackendsRequest(), timeout=10)]
            try:
                frame = render(await calls[0], title)
            except asyncio.CancelledError:
                if stop.is_set():  # interrupt() cancelled the call: a gateway that does not answer
                    break
                raise
            except grpc.aio.AioRpcError as err:
                if stop.is_set():
                    break
                if args.once:
                    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
                    return 1
                frame = f"{title}\nerror: {err.code().name}: {err.details()}\n"
            out.write(clear + frame if clear else frame + ("" if args.once else "\n"))
            out.flush()
            if args.once:
                return 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)
    return 0
