"""The ``llamamesh`` command.

  llamamesh serve                 a whole node: embedded Valkey (unless LLAMAMESH_REDIS_URL), gateway, CPU worker
  llamamesh gateway | worker      one process of a node (what Kubernetes runs)
  llamamesh generate "..."        stream an answer to the terminal
  llamamesh demo "..."            start a node, stream one answer, stop
  llamamesh models | tokenize     the models served; a prompt's token ids
  llamamesh top [--once]          each pool: workers, requests in flight / slots, queue, tokens/s (AdminService)
  llamamesh batch submit FILE.jsonl [--summarise]   submit a durable batch, show its progress
  llamamesh batch status | results | cancel | list  follow it (JSONL formats: llamamesh/batchfile.py)
  llamamesh auth create-key TENANT [--admin] | revoke-key KEY_ID | list-keys   the tenants file
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from llamamesh import batchfile, logs, tenants, top
from llamamesh.client import DEFAULT_ADDRESS, Client, build_request, field_violations
from llamamesh.node import Node, StartFailed
from llamamesh.settings import ClientSettings, Settings
from llamamesh.v1 import admin_pb2 as admin_pb
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb


def _node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="gateway listen address (LLAMAMESH_GATEWAY_HOST)")
    p.add_argument("--port", type=int, help="gateway port (LLAMAMESH_GATEWAY_PORT)")
    p.add_argument("--redis-url", help="use this Redis instead of the embedded Valkey (LLAMAMESH_REDIS_URL)")
    p.add_argument("--engine", help="worker engine: transformers (default) or fake (LLAMAMESH_WORKER_ENGINE)")
    p.add_argument("--threads", type=int, help="CPU engine torch threads (LLAMAMESH_WORKER_THREADS)")
    p.add_argument("--max-inflight", type=int, help="requests per worker (LLAMAMESH_WORKER_MAX_INFLIGHT)")
    p.add_argument("--model-path", help="model folder or .gguf (LLAMAMESH_WORKER_MODEL_PATH)")
    p.add_argument("--workers", type=int, default=1, help="worker processes on this node")


def _gen_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="what to ask")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--system", help="a system message before the prompt")
    p.add_argument("--model", default="", help="model name (default: the gateway's default)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, help="0 = greedy (the default; 1 with --n above 1)")
    p.add_argument("--n", type=int, help="parallel samples of the answer (printed one after another)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    _format_flags(p)
    p.add_argument("--regex", help="the answer matches this regular expression")
    p.add_argument("--choice", action="append", help="the answer is one of these (repeatable)")


def _format_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-schema", metavar="FILE", type=_file_text,
                   help="the answer is JSON that validates against the JSON schema in FILE")  # fmt: skip


def _file_text(path: str) -> str:
    """A file's text, read while the arguments are parsed (sent as it is: the gateway checks it)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from exc


def _client_flags(p: argparse.ArgumentParser) -> None:
    """How a command reaches a running gateway; each flag defaults to its LLAMAMESH_CLIENT_* variable."""
    p.add_argument("--api-key", help="sent as authorization: Bearer KEY (LLAMAMESH_CLIENT_API_KEY)")
    p.add_argument("--tls-ca", help="TLS: the CA that signed the gateway's certificate (LLAMAMESH_CLIENT_TLS_CA)")
    p.add_argument("--tls", action="store_true", help="TLS with the system's CAs (implied by --tls-ca)")
    p.add_argument("--tls-cert", help="mutual TLS: this client's certificate (LLAMAMESH_CLIENT_TLS_CERT)")
    p.add_argument("--tls-key", help="mutual TLS: this client's key (LLAMAMESH_CLIENT_TLS_KEY)")
    p.add_argument("--tls-server-name",
                   help="the name the gateway's certificate must carry (LLAMAMESH_CLIENT_TLS_SERVER_NAME)")  # fmt: skip


def _client_settings(args: argparse.Namespace) -> ClientSettings:
    """The environment's client settings with the command's flags over them."""
    return Settings.from_env().with_overrides(client={
        name: getattr(args, name, None) for name in ("api_key", "tls_ca", "tls_cert", "tls_key", "tls_server_name")
    }).client  # fmt: skip


def _client(address: str, args: argparse.Namespace) -> Client:
    return Client.from_settings(address, _client_settings(args), tls=bool(getattr(args, "tls", False)))


def _settings(args: argparse.Namespace) -> Settings:
    s = Settings.from_env()
    return s.with_overrides(
        redis={"url": getattr(args, "redis_url", None)},
        gateway={"host": getattr(args, "host", None), "port": getattr(args, "port", None)},
        worker={
            "engine": getattr(args, "engine", None),
            "threads": getattr(args, "threads", None),
            "max_inflight": getattr(args, "max_inflight", None),
            "model_path": getattr(args, "model_path", None),
        },
    )


async def _generate(address: str, args: argparse.Namespace, wait_s: float, out: Any = sys.stdout) -> int:
    messages = None
    prompt = None
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
    async with _client(address, args) as client:
        if wait_s:
            await client.wait_ready(wait_s)
        n = args.n or 1
        temperature = args.temperature if args.temperature is not None else (1.0 if n > 1 else 0.0)
        samples: dict[int, list[str]] = {}
        ends: dict[int, int] = {}
        try:
            last = None
            async for msg in client.generate(
                prompt,
                messages,
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
            ):
                if n > 1:  # samples interleave: each is printed whole once the stream ends
                    samples.setdefault(msg.sample, []).append(msg.text)
                    ends[msg.sample] = msg.finish_reason or ends.get(msg.sample, 0)
                else:
                    out.write(msg.text)
                    out.flush()
                last = msg
        except grpc.aio.AioRpcError as err:
            fields = field_violations(err)
            print(f"\nerror: {err.code().name}: {err.details()}" + (f" (fields: {fields})" if fields else ""),
                  file=sys.stderr)
            return 1
    for k in sorted(samples):
        finish = _finish(ends[k]) if ends[k] else None
        out.write(("\n" if k else "") + f"--- sample {k} (finish={finish})\n" + "".join(samples[k]))
    if last is not None:
        t = last.timings
        print(
            f"\n[{last.usage.completion_tokens} tokens, finish={last.finish_reason and _finish(last.finish_reason)}, "
            f"ttft={t.time_to_first_token.ToMilliseconds()} ms, total={t.total.ToMilliseconds()} ms]",
            file=sys.stderr,
        )
    return 0


def _finish(value: int) -> str:

    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    logs.configure(settings.log, "node")
    node = Node(settings, workers=args.workers)
    try:
        node.start()
        print(f"llamamesh starting on {node.address} with {args.workers} worker(s) ...", file=sys.stderr)
        took = asyncio.run(node.wait_ready(sys.stderr))
        print(f"llamamesh serving on {node.address} (ready in {took:.1f} s; Ctrl-C stops)", file=sys.stderr)
        return node.wait()
    except (StartFailed, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        node.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.port is None:  # a free port, so a demo never collides with a running node
        settings = settings.with_overrides(gateway={"port": _free_port()})
    logs.configure(replace(settings.log, level="warning", format="console"), "demo")
    log_file = Path(tempfile.gettempdir()) / "llamamesh-demo.log"
    node = Node(settings, workers=1, log_file=log_file)
    t0 = time.monotonic()
    print(f"starting a node on {settings.gateway.host}:{settings.gateway.port} (logs: {log_file})", file=sys.stderr)
    try:
        node.start()
        asyncio.run(node.wait_ready(sys.stderr))
        print(f"> {args.prompt}\n", file=sys.stderr)
        args.tls = bool(settings.gateway.tls_cert)  # the node's gateway speaks TLS: so does the demo's client
        code = asyncio.run(_generate(node.address, args, wait_s=0))
        print(f"[demo done in {time.monotonic() - t0:.1f} s]", file=sys.stderr)
        return code
    except (StartFailed, OSError) as exc:
        print(f"error: {exc} (logs: {log_file})", file=sys.stderr)
        return 1
    finally:
        node.stop()


def cmd_generate(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args.address, args, wait_s=args.wait))


def cmd_models(args: argparse.Namespace) -> int:
    async def run() -> None:
        async with _client(args.address, args) as c:
            for m in await c.list_models():
                print(f"{m.id}\tpool={m.pool}" + ("\tdefault" if m.default else "")
                      + (f"\tadapter of {m.base}" if m.adapter else ""))  # fmt: skip

    asyncio.run(run())
    return 0


def cmd_adapter(args: argparse.Namespace) -> int:
    """Load or unload a LoRA adapter of a pool (AdminService: an admin key)."""

    async def run() -> None:
        async with _client(args.address, args) as c:
            if args.action == "load":
                workers = await c.load_adapter(args.name, args.path, args.model, args.wait)
                print(f"adapter {args.name} served by {', '.join(workers)}")
            else:
                pending = await c.unload_adapter(args.name, args.model, args.wait)
                print(f"adapter {args.name} unloaded" + (f"; still served by {', '.join(pending)} (in use)"
                                                          if pending else ""))  # fmt: skip

    try:
        asyncio.run(run())
    except grpc.aio.AioRpcError as err:
        fields = field_violations(err)
        print(f"error: {err.code().name}: {err.details()}" + (f" (fields: {fields})" if fields else ""),
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    async def run() -> None:
        async with _client(args.address, args) as c:
            ids = await c.tokenize(args.text, model=args.model)
            print(" ".join(map(str, ids)))
            print(f"[{len(ids)} tokens]", file=sys.stderr)

    asyncio.run(run())
    return 0


async def _top(args: argparse.Namespace, out: Any) -> int:
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""  # home and clear; a pipe gets plain frames
    # Ctrl-C sets ``stop`` and cancels the call in flight, rather than asyncio.run cancelling this
    # task: a task cancel that lands as grpc.aio's unary call completes is lost (its inner task
    # swallows the CancelledError; the await returns, or raises an AioRpcError with status OK), and
    # top went on redrawing.
    stop = asyncio.Event()
    calls: list[Any] = []  # the ListBackends in flight

    def interrupt() -> None:
        stop.set()
        for call in calls:
            call.cancel()

    with contextlib.suppress(NotImplementedError):  # Windows: asyncio.run's cancel, as before
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupt)  # the loop's close removes it
    async with _client(args.address, args) as c:
        while not stop.is_set():
            title = f"llamamesh top  {args.address}  {time.strftime('%H:%M:%S')}"
            calls[:] = [c.admin.ListBackends(admin_pb.ListBackendsRequest(), timeout=10)]
            try:
                frame = top.render(await calls[0], title)
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


def cmd_top(args: argparse.Namespace) -> int:
    """Frames until Ctrl-C (which ends it with 0), or one with --once."""
    try:
        return asyncio.run(_top(args, sys.stdout))
    except KeyboardInterrupt:
        return 0


# --- batches


def _meta(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    return (("x-llamamesh-tenant", args.tenant),) if args.tenant else ()


ENDED = (bpb.BATCH_STATE_COMPLETED, bpb.BATCH_STATE_FAILED, bpb.BATCH_STATE_EXPIRED, bpb.BATCH_STATE_CANCELLED)


def _progress(b: bpb.Batch, out: Any) -> None:
    c = b.counts
    done = c.total - c.processing
    width = 30
    bar = "#" * (width * done // max(c.total, 1))
    state = bpb.BatchState.Name(b.state).removeprefix("BATCH_STATE_").lower()
    out.write(f"\r[{bar:<{width}}] {done}/{c.total} {state}: {c.succeeded} ok, {c.errored} errored, "
              f"{c.cancelled} cancelled, {c.expired} expired ")  # fmt: skip
    out.flush()


def cmd_batch(args: argparse.Namespace) -> int:
    """Files are read and opened here, outside the event loop."""
    try:
        lines: list[str] = []
        if args.action == "submit":
            with open(args.file, encoding="utf-8") as f:
                lines = f.readlines()
        out = open(args.output, "a", encoding="utf-8") if getattr(args, "output", None) else sys.stdout  # noqa: SIM115
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_batch(args, lines, out))
    finally:
        if out is not sys.stdout:
            out.close()


async def _batch(args: argparse.Namespace, lines: list[str], out: Any) -> int:
    async with _client(args.address, args) as c:
        stub, meta = c.batches, _meta(args)
        try:
            if args.action == "submit":
                req = bpb.BatchGenerateRequest(batch_id=args.batch_id or "")
                if args.window:
                    req.completion_window_s = args.window
                if args.summarise:
                    params = build_request(model=args.model, max_tokens=args.max_tokens,
                                           temperature=args.temperature, json_schema=args.json_schema)  # fmt: skip
                    req.summarise.CopyFrom(batchfile.summarise_request(lines, params, args.template or ""))
                elif args.json_schema:
                    print("error: --json-schema goes with --summarise (items carry their own response_format)",
                          file=sys.stderr)  # fmt: skip
                    return 2
                else:
                    req.items.extend(batchfile.items(lines))
                b = await stub.BatchGenerate(req, metadata=meta)
                print(b.batch_id)
                while not args.no_wait and b.state not in ENDED:
                    _progress(b, sys.stderr)
                    await asyncio.sleep(0.5)  # the progress bar's refresh
                    b = await stub.GetBatch(bpb.GetBatchRequest(batch_id=b.batch_id), metadata=meta)
                if not args.no_wait:
                    _progress(b, sys.stderr)
                    print(file=sys.stderr)
            elif args.action == "status":
                print(batchfile.batch_json(await stub.GetBatch(bpb.GetBatchRequest(batch_id=args.id), metadata=meta)))
            elif args.action == "cancel":
                b = await stub.CancelBatch(bpb.CancelBatchRequest(batch_id=args.id), metadata=meta)
                print(batchfile.batch_json(b))
            elif args.action == "list":
                page = await stub.ListBatches(bpb.ListBatchesRequest(page_size=args.limit), metadata=meta)
                for b in page.batches:
                    state = bpb.BatchState.Name(b.state).removeprefix("BATCH_STATE_").lower()
                    print(f"{b.batch_id}\t{state}\t{b.counts.total - b.counts.processing}/{b.counts.total}")
            elif args.action == "results":
                request = bpb.StreamBatchResultsRequest(batch_id=args.id, cursor=args.cursor or "", follow=args.follow)
                n = 0
                async for r in stub.StreamBatchResults(request, metadata=meta):
                    out.write(batchfile.result_line(r) + "\n")
                    n += 1
                print(f"[{n} results]", file=sys.stderr)
        except grpc.aio.AioRpcError as exc:
            fields = field_violations(exc)
            print(f"error: {exc.code().name}: {exc.details()}" + (f" (fields: {', '.join(fields)})" if fields else ""),
                  file=sys.stderr)  # fmt: skip
            return 1
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


def _batch_flags(sub: Any) -> None:
    p = sub.add_parser("batch", help="durable batch jobs: submit, status, results, cancel, list")
    acts = p.add_subparsers(dest="action", required=True)
    for name in ("submit", "status", "results", "cancel", "list"):
        a = acts.add_parser(name)
        a.add_argument("--address", default=DEFAULT_ADDRESS)
        a.add_argument("--tenant", default="", help="the owner the batch is recorded under (x-llamamesh-tenant)")
        _client_flags(a)
        if name == "submit":
            a.add_argument("file", help="JSONL: {custom_id, text} with --summarise, else {custom_id, request}")
            a.add_argument("--summarise", action="store_true", help="each line is a document to summarise")
            a.add_argument("--template", help="the summarisation prompt; {document} is replaced")
            _format_flags(a)
            a.add_argument("--model", default="")
            a.add_argument("--max-tokens", type=int, default=128)
            a.add_argument("--temperature", type=float, default=0.0)
            a.add_argument("--batch-id", help="your id for it (submitting it again is harmless)")
            a.add_argument("--window", type=int, help="seconds in which items must start (default 24 h)")
            a.add_argument("--no-wait", action="store_true", help="print the id and return")
        elif name == "list":
            a.add_argument("--limit", type=int, default=20)
        else:
            a.add_argument("id", help="the batch id")
        if name == "results":
            a.add_argument("-o", "--output", help="append the results to this JSONL file (default: stdout)")
            a.add_argument("--cursor", help="resume after this result's cursor")
            a.add_argument("--follow", action=argparse.BooleanOptionalAction, default=True,
                           help="wait until the batch ends (default)")  # fmt: skip
        a.set_defaults(func=cmd_batch)


def _exec_module(module: str, args: argparse.Namespace) -> int:
    env = {**os.environ, **_settings(args).to_env()}
    os.execvpe(sys.executable, [sys.executable, "-m", module], env)
    return 1  # not reached


def cmd_auth(args: argparse.Namespace) -> int:
    """The tenants file: add a key (printed once: only its hash is kept), revoke one, list them."""
    path = args.file or Settings.from_env().auth.file
    if not path:
        print("llamamesh auth: give --file or set LLAMAMESH_AUTH_FILE", file=sys.stderr)
        return 2
    try:
        if args.action == "create-key":
            key_id, key = tenants.create_key(path, args.tenant, admin=args.admin)
            print(key)
            print(f"key id {key_id} for tenant {args.tenant}{' (admin)' if args.admin else ''} added to {path}; "
                  "the key is shown only now", file=sys.stderr)  # fmt: skip
        elif args.action == "revoke-key":
            tenants.revoke_key(path, args.key_id)
            print(f"key {args.key_id} revoked in {path}", file=sys.stderr)
        else:
            for k in tenants.list_keys(path):
                print(json.dumps(k))
    except KeyError as exc:
        print(f"llamamesh auth: no key {exc.args[0]!r} in {path}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"llamamesh auth: {exc}", file=sys.stderr)
        return 1
    return 0


def _auth_flags(sub: Any) -> None:
    p = sub.add_parser("auth", help="API keys in the tenants file (LLAMAMESH_AUTH_FILE)")
    acts = p.add_subparsers(dest="action", required=True)
    a = acts.add_parser("create-key", help="add a key for TENANT and print it once")
    a.add_argument("tenant")
    a.add_argument("--admin", action="store_true", help="the key may call AdminService")
    b = acts.add_parser("revoke-key", help="revoke a key by its id")
    b.add_argument("key_id")
    acts.add_parser("list-keys", help="every key's id, tenant, admin flag, creation and revocation")
    for q in (a, b, *acts.choices.values()):
        if not any(x.dest == "file" for x in q._actions):
            q.add_argument("--file", help="the tenants file (default: LLAMAMESH_AUTH_FILE)")
    p.set_defaults(func=cmd_auth)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llamamesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run a whole node")
    _node_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="start a node, stream one answer, stop")
    _node_flags(p)
    _gen_flags(p)
    p.set_defaults(func=cmd_demo)

    for name, module in (("gateway", "services"), ("worker", "workers")):
        p = sub.add_parser(name, help=f"run only the {name} process")
        _node_flags(p)
        p.set_defaults(func=lambda a, m=module: _exec_module(m, a))

    p = sub.add_parser("generate", help="stream an answer from a running gateway")
    _gen_flags(p)
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the gateway")
    _client_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("models", help="list the models a gateway serves")
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    _client_flags(p)
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
        q.add_argument("--address", default=DEFAULT_ADDRESS)
        _client_flags(q)
    p.set_defaults(func=cmd_adapter)

    p = sub.add_parser("top", help="each pool's workers, requests in flight, queue and tokens/s, refreshed")
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    _client_flags(p)
    p.set_defaults(func=cmd_top)

    _batch_flags(sub)

    p = sub.add_parser("tokenize", help="token ids of a text")
    p.add_argument("text")
    p.add_argument("--model", default="")
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    _client_flags(p)
    p.set_defaults(func=cmd_tokenize)

    _auth_flags(sub)

    args = parser.parse_args(argv)
    try:
        sys.exit(args.func(args))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
