"""``llamamesh models | tokenize | adapter``: what a running gateway serves, a text's token ids, and
the LoRA adapters of a model's pool."""

from __future__ import annotations

import argparse
import asyncio
import sys

from llamamesh.cli import flags


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="list the models a gateway serves")
    flags.client_flags(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("adapter", help="load or unload a LoRA adapter of a model's pool (admin)")
    acts = p.add_subparsers(dest="action", required=True)
    q = acts.add_parser("load", help="load a PEFT adapter folder (as the workers see it) into every worker")
    q.add_argument("name")
    q.add_argument("path")
    q = acts.add_parser("unload", help="unload a run-time adapter")
    q.add_argument("name")
    for q in acts.choices.values():
        q.add_argument("--wait", type=int, help="seconds to wait for the workers (default 60)")
        q.add_argument("--model", default="", help="the base model (default: the gateway's default)")
        flags.client_flags(q)
    p.set_defaults(func=cmd_adapter)

    p = sub.add_parser("tokenize", help="token ids of a text")
    p.add_argument("text")
    p.add_argument("--model", default="")
    flags.client_flags(p)
    p.set_defaults(func=cmd_tokenize)


def cmd_models(args: argparse.Namespace) -> int:
    async def run() -> None:
        async with flags.client(args.address, args) as c:
            for m in await c.list_models():
                print(
                    f"{m.id}\tpool={m.pool}"
                    + ("\tdefault" if m.default else "")
                    + (f"\tadapter of {m.base}" if m.adapter else "")
                )

    asyncio.run(run())
    return 0


def cmd_adapter(args: argparse.Namespace) -> int:
    """Load or unload a LoRA adapter of a pool (AdminService: an admin key)."""

    async def run() -> None:
        async with flags.client(args.address, args) as c:
            if args.action == "load":
                workers = await c.load_adapter(args.name, args.path, args.model, args.wait)
                print(f"adapter {args.name} served by {', '.join(workers)}")
            else:
                pending = await c.unload_adapter(args.name, args.model, args.wait)
                print(
                    f"adapter {args.name} unloaded"
                    + (f"; still served by {', '.join(pending)} (in use)" if pending else "")
                )

    asyncio.run(run())  # (a refused call: one line, from the command's main)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    async def run() -> None:
        async with flags.client(args.address, args) as c:
            ids = await c.tokenize(args.text, model=args.model)
            print(" ".join(map(str, ids)))
            print(f"[{len(ids)} tokens]", file=sys.stderr)

    asyncio.run(run())
    return 0
