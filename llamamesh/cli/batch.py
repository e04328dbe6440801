"""``llamamesh batch submit | status | results | cancel | list``: durable batches of a running gateway
(BatchService); the JSONL files they read and write are ``batchfile``'s."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import grpc

from llamamesh.cli import batchfile, flags
from llamamesh.client import build_request
from llamamesh.v1 import batch_pb2 as bpb

ENDED = (bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_FAILED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_CANCELLED)
Metadata = tuple[tuple[str, str], ...]


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("batch", help="durable batch jobs: submit, status, results, cancel, list")
    acts = p.add_subparsers(dest="action", required=True)
    for name in ("submit", "status", "results", "cancel", "list"):
        a = acts.add_parser(name)
        a.add_argument("--tenant", default="", help="the owner the batch is recorded under (x-llamamesh-tenant)")
        flags.client_flags(a)
        if name == "submit":
            _submit_flags(a)
        elif name == "list":
            limit = flags.between(1, 100)
            a.add_argument("--limit", type=limit, default=20, help="batches listed, newest first (1-100; default 20)")
        else:
            a.add_argument("id", help="the batch id")
        if name == "results":
            a.add_argument("-o", "--output", help="append the results to this JSONL file (default: stdout)")
            a.add_argument("--cursor", help="resume after this result's cursor")
            a.add_argument(
                "--follow",
                action=argparse.BooleanOptionalAction,
                default=True,
                help="wait until the batch ends (default)",
            )
        a.set_defaults(func=cmd_batch)


def _submit_flags(a: argparse.ArgumentParser) -> None:
    a.add_argument("file", help="JSONL: {custom_id, text} with --summarise, else {custom_id, request}")
    a.add_argument("--summarise", action="store_true", help="each line is a document to summarise")
    a.add_argument("--template", help="the summarisation prompt; {document} is replaced")
    flags.format_flags(a)
    a.add_argument("--model", help="with --summarise: the model (default: the gateway's default)")
    a.add_argument("--max-tokens", type=flags.between(1, flags.INT32_MAX), help="with --summarise (default 128)")
    a.add_argument("--temperature", type=float, help="with --summarise (default 0)")
    a.add_argument("--batch-id", help="your id for it (submitting it again is harmless)")
    a.add_argument(
        "--window", type=flags.at_least(10), help="seconds in which items must start (at least 10; default 24 h)"
    )
    a.add_argument("--no-wait", action="store_true", help="print the id and return")


def cmd_batch(args: argparse.Namespace) -> int:
    """Files are read and opened here, outside the event loop."""
    try:
        lines: list[str] = []
        if args.action == "submit":
            with open(args.file, encoding="utf-8") as f:
                lines = f.readlines()
        out = open(args.output, "a", encoding="utf-8") if getattr(args, "output", None) else sys.stdout  # noqa: SIM115
    except (OSError, UnicodeDecodeError) as exc:
        named = args.file if args.action == "submit" else f"-o {args.output}"
        print(f"error: {named}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_batch(args, lines, out))
    finally:
        if out is not sys.stdout:
            out.close()


async def _batch(args: argparse.Namespace, lines: list[str], out: TextIO) -> int:
    meta: Metadata = (("x-llamamesh-tenant", args.tenant),) if args.tenant else ()
    async with flags.client(args.address, args) as c:
        try:
            if args.action == "submit":
                await _submit(c.batches, meta, args, lines)
            else:
                await ACTIONS[args.action](c.batches, meta, args, out)
        except grpc.aio.AioRpcError as exc:
            print(flags.rpc_error(exc, batchfile.line_names(lines)), file=sys.stderr)
            return 1
        except ValueError as exc:  # a bad input file, or flags that do not go together
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


# The flags that set a summarisation's one request; a file of items carries a request a line.
SUMMARISE_ONLY = ("model", "max_tokens", "temperature", "json_schema", "template")


async def _submit(stub: Any, meta: Metadata, args: argparse.Namespace, lines: list[str]) -> None:
    """Submit the file's batch, print its id and, unless --no-wait, its progress until it ends."""
    req = bpb.BatchGenerateRequest(batch_id=args.batch_id or "")
    if args.window:
        req.completion_window_s = args.window
    if args.summarise:
        params = build_request(
            model=args.model or "",
            max_tokens=128 if args.max_tokens is None else args.max_tokens,
            temperature=args.temperature or 0.0,
            json_schema=args.json_schema,
        )
        req.summarise.CopyFrom(batchfile.summarise_request(lines, params, args.template or ""))
    elif given := [f for f in SUMMARISE_ONLY if getattr(args, f) not in (None, "")]:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} goes with --summarise (each item's request carries its own)")
    else:
        req.items.extend(batchfile.items(lines))
    b = await stub.BatchGenerate(req, metadata=meta)
    print(b.batch_id)
    if args.no_wait:
        return
    shown = ""
    while b.state not in ENDED:
        shown = _progress(b, sys.stderr, shown)
        await asyncio.sleep(0.5)  # the progress bar's refresh
        b = await stub.GetBatch(bpb.GetBatchRequest(batch_id=b.batch_id), metadata=meta)
    _progress(b, sys.stderr, shown)
    if sys.stderr.isatty():
        print(file=sys.stderr)


def _progress(b: bpb.Batch, out: TextIO, shown: str) -> str:
    """Show the batch's progress, unless it is ``shown`` already: on a terminal a bar redrawn in
    place, elsewhere (a log file) a line per change. Returns what it shows."""
    c = b.counts
    done = c.total - c.processing
    width = 30
    bar = "#" * (width * done // max(c.total, 1))
    state = bpb.BatchState.Name(b.state).removeprefix("BATCH_STATE_").lower()
    line = (
        f"[{bar:<{width}}] {done}/{c.total} {state}: {c.succeeded} ok, {c.errored} errored, "
        f"{c.cancelled} cancelled, {c.expired} expired; tokens {b.usage.prompt_tokens} in, "
        f"{b.usage.completion_tokens} out "
    )
    if out.isatty():
        out.write(f"\r{line}")
    elif line != shown:
        out.write(f"{line.rstrip()}\n")
    out.flush()
    return line


async def _status(stub: Any, meta: Metadata, args: argparse.Namespace, out: TextIO) -> None:
    print(batchfile.batch_json(await stub.GetBatch(bpb.GetBatchRequest(batch_id=args.id), metadata=meta)))


async def _cancel(stub: Any, meta: Metadata, args: argparse.Namespace, out: TextIO) -> None:
    print(batchfile.batch_json(await stub.CancelBatch(bpb.CancelBatchRequest(batch_id=args.id), metadata=meta)))


async def _list(stub: Any, meta: Metadata, args: argparse.Namespace, out: TextIO) -> None:
    page = await stub.ListBatches(bpb.ListBatchesRequest(page_size=args.limit), metadata=meta)
    for b in page.batches:
        state = bpb.BatchState.Name(b.state).removeprefix("BATCH_STATE_").lower()
        print(f"{b.batch_id}\t{state}\t{b.counts.total - b.counts.processing}/{b.counts.total}")


async def _results(stub: Any, meta: Metadata, args: argparse.Namespace, out: TextIO) -> None:
    """Each result as a JSONL line on ``out``, then their count on stderr. An item's result comes
    once: a repeat (its first result lost with Redis's last second, the item run again) is skipped."""
    request = bpb.StreamBatchResultsRequest(batch_id=args.id, cursor=args.cursor or "", follow=args.follow)
    n = 0
    seen: set[str] = set()
    async for r in stub.StreamBatchResults(request, metadata=meta):
        if r.custom_id in seen:
            continue
        seen.add(r.custom_id)
        out.write(batchfile.result_line(r) + "\n")
        out.flush()  # (a line as it comes: a file followed, or cut short by a stop, holds every result so far)
        n += 1
    print(f"[{n} results]", file=sys.stderr)


Action = Callable[[Any, Metadata, argparse.Namespace, TextIO], Awaitable[None]]
ACTIONS: dict[str, Action] = {"status": _status, "cancel": _cancel, "list": _list, "results": _results}
