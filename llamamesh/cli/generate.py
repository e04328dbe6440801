"""``llamamesh generate``: an answer streamed from a running gateway to the terminal (``demo`` streams
its node's answer the same way)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import aclosing
from typing import Any, TextIO

import grpc

from llamamesh.cli import flags
from llamamesh.client import Messages
from llamamesh.v1 import generation_pb2 as pb


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="stream an answer from a running gateway")
    flags.generation_flags(p)
    p.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the gateway")
    flags.client_flags(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.raw and args.system:
        print("error: --system goes with a chat prompt, not --raw (a raw prompt has no messages)", file=sys.stderr)
        return 2
    return asyncio.run(stream_answer(args.address, args, wait_s=args.wait))


async def stream_answer(address: str, args: argparse.Namespace, wait_s: float, out: TextIO = sys.stdout) -> int:
    """Stream the answer to ``args.prompt`` onto ``out`` (``n`` > 1: each sample whole once the stream
    ends), then its token count, finish and timings on stderr; 1 if the gateway refused it."""
    prompt, messages = _prompt(args)
    n = args.n or 1
    samples: dict[int, list[str]] = {}
    ends: dict[int, int] = {}
    last = None
    async with flags.client(address, args) as client:
        if wait_s:
            await client.wait_ready(wait_s)
        # (aclosing: a reader gone mid-answer cancels the request now, while the channel is open)
        try:
            async with aclosing(client.generate(prompt, messages, **_fields(args, n))) as stream:
                async for msg in stream:
                    if n > 1:  # samples interleave: each is printed whole once the stream ends
                        samples.setdefault(msg.sample, []).append(msg.text)
                        ends[msg.sample] = msg.finish_reason or ends.get(msg.sample, 0)
                    else:
                        out.write(msg.text)
                        out.flush()
                    last = msg
        except grpc.aio.AioRpcError as err:
            began = last is not None and n == 1  # the answer so far ends without a newline
            print(("\n" if began else "") + flags.rpc_error(err), file=sys.stderr)
            return 1
    for k in sorted(samples):
        finish = _finish(ends[k]) if ends[k] else None
        out.write(("\n" if k else "") + f"--- sample {k} (finish={finish})\n" + "".join(samples[k]))
    if last is not None:
        _summary(last)
    return 0


def _prompt(args: argparse.Namespace) -> tuple[str | None, Messages | None]:
    """The raw prompt, or the chat messages (a system message first if given)."""
    if args.raw:
        return args.prompt, None
    return None, ([("system", args.system)] if args.system else []) + [("user", args.prompt)]


def _fields(args: argparse.Namespace, n: int) -> dict[str, Any]:
    temperature = args.temperature if args.temperature is not None else (1.0 if n > 1 else 0.0)
    return dict(
        model=args.model or None,
        max_tokens=args.max_tokens,
        temperature=temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        n=args.n,
        json_schema=args.json_schema,
        regex=args.regex,
        choice=args.choice,
    )


def _summary(last: pb.GenerateResponse) -> None:
    """The last message's token count, finish and timings, on stderr."""
    t = last.timings
    print(
        f"\n[{last.usage.completion_tokens} tokens, finish={last.finish_reason and _finish(last.finish_reason)}, "
        f"ttft={t.time_to_first_token.ToMilliseconds()} ms, total={t.total.ToMilliseconds()} ms]",
        file=sys.stderr,
    )


def _finish(value: int) -> str:
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
