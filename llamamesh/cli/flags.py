"""The flags commands share (how a command reaches a gateway, what a node runs, what to generate) and
the settings and client they make."""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc

from llamamesh.client import DEFAULT_ADDRESS, Client, field_violations
from llamamesh.settings import ClientSettings, Settings

CLIENT_FLAGS = ("api_key", "tls_ca", "tls_cert", "tls_key", "tls_server_name")


class BadSetting(Exception):
    """A setting, from the environment or a flag, that cannot be used; the message names its variable."""


def redis_flags(p: argparse.ArgumentParser, embedded: bool = True) -> None:
    """``embedded``: an unset URL starts the embedded Valkey (a node, not a lone process)."""
    what = "use this Redis instead of the embedded Valkey" if embedded else "the Redis to use"
    p.add_argument("--redis-url", help=f"{what} (LLAMAMESH_REDIS_URL)")


def gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="gateway listen address (LLAMAMESH_GATEWAY_HOST)")
    p.add_argument("--port", type=int, help="gateway port (LLAMAMESH_GATEWAY_PORT)")


def worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", help="worker engine: transformers (default) or fake (LLAMAMESH_WORKER_ENGINE)")
    p.add_argument("--threads", type=int, help="CPU engine torch threads (LLAMAMESH_WORKER_THREADS)")
    p.add_argument("--max-inflight", type=int, help="requests per worker (LLAMAMESH_WORKER_MAX_INFLIGHT)")
    p.add_argument("--model-path", help="model folder or .gguf (LLAMAMESH_WORKER_MODEL_PATH)")


def node_flags(p: argparse.ArgumentParser) -> None:
    """A whole node's: its gateway's, its workers', and how many workers."""
    gateway_flags(p)
    redis_flags(p)
    worker_flags(p)
    p.add_argument("--workers", type=at_least(0), default=1, help="worker processes on this node")


def settings(args: argparse.Namespace) -> Settings:
    """The environment's settings with the command's node flags (those it has) over them; raises
    BadSetting."""
    try:
        return Settings.from_env().with_overrides(
            redis={"url": getattr(args, "redis_url", None)},
            gateway={"host": getattr(args, "host", None), "port": getattr(args, "port", None)},
            worker={
                "engine": getattr(args, "engine", None),
                "threads": getattr(args, "threads", None),
                "max_inflight": getattr(args, "max_inflight", None),
                "model_path": getattr(args, "model_path", None),
            },
        )
    except ValueError as exc:
        raise BadSetting(str(exc)) from exc


def generation_flags(p: argparse.ArgumentParser) -> None:
    """What to ask and how to sample the answer (``generate`` and ``demo``)."""
    p.add_argument("prompt", help="what to ask")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--system", help="a system message before the prompt")
    p.add_argument("--model", default="", help="model name (default: the gateway's default)")
    p.add_argument("--max-tokens", type=between(1, INT32_MAX), default=128)
    p.add_argument("--temperature", type=float, help="0 = greedy (the default; 1 with --n above 1)")
    p.add_argument("--n", type=between(1, INT32_MAX), help="parallel samples of the answer (printed one after another)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=between(-(2**63), 2**63 - 1))
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    format_flags(p)
    p.add_argument("--regex", help="the answer matches this regular expression")
    p.add_argument("--choice", action="append", help="the answer is one of these (repeatable)")


def format_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        type=file_text,
        help="the answer is JSON that validates against the JSON schema in FILE",
    )


def at_least(low: float, kind: type[int] | type[float] = int) -> Callable[[str], float]:
    """An argparse type: a number (``kind``) of at least ``low`` (argparse names the flag)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= low:  # (also NaN)
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


INT32_MAX = 2**31 - 1


def between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], the field's range on the wire (argparse names the
    flag; the gateway's own bounds, such as max_tokens' cap, come back from it)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value

    return parse


def file_text(path: str) -> str:
    """A file's text, read while the arguments are parsed (sent as it is: the gateway checks it)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from exc


def client_flags(p: argparse.ArgumentParser) -> None:
    """How a command reaches a running gateway; each flag defaults to its LLAMAMESH_CLIENT_* variable."""
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--api-key", help="sent as authorization: Bearer KEY (LLAMAMESH_CLIENT_API_KEY)")
    p.add_argument("--tls-ca", help="TLS: the CA that signed the gateway's certificate (LLAMAMESH_CLIENT_TLS_CA)")
    p.add_argument("--tls", action="store_true", help="TLS with the system's CAs (implied by --tls-ca)")
    p.add_argument("--tls-cert", help="mutual TLS: this client's certificate (LLAMAMESH_CLIENT_TLS_CERT)")
    p.add_argument("--tls-key", help="mutual TLS: this client's key (LLAMAMESH_CLIENT_TLS_KEY)")
    p.add_argument(
        "--tls-server-name", help="the name the gateway's certificate must carry (LLAMAMESH_CLIENT_TLS_SERVER_NAME)"
    )


def client_settings(args: argparse.Namespace) -> ClientSettings:
    """The environment's client settings with the command's flags over them; raises BadSetting."""
    overrides = {name: getattr(args, name, None) for name in CLIENT_FLAGS}
    try:
        return Settings.from_env().with_overrides(client=overrides).client
    except ValueError as exc:
        raise BadSetting(str(exc)) from exc


def client(address: str, args: argparse.Namespace) -> Client:
    """A client of the gateway at ``address`` with the command's client settings; raises BadSetting
    for a TLS file it cannot read (read now: the channel reads them only when it connects)."""
    settings = client_settings(args)
    for name in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(settings, name)
        try:
            if path:
                Path(path).read_bytes()
        except OSError as exc:
            flag = f"--{name.replace('_', '-')}"
            raise BadSetting(f"LLAMAMESH_CLIENT_{name.upper()} ({flag}): cannot read {path}: {exc.strerror}") from None
    _check_pem(settings)
    return Client.from_settings(address, settings, tls=bool(getattr(args, "tls", False)))


def _check_pem(settings: ClientSettings) -> None:
    """BadSetting for a TLS file that is not what its flag says: gRPC reads them only when it
    connects, and then says no more than that the handshake failed (after its own log lines)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if settings.tls_ca:
        try:
            ctx.load_verify_locations(cafile=settings.tls_ca)
        except ssl.SSLError as exc:
            why = f"{settings.tls_ca} holds no PEM certificate ({exc.reason or exc})"
            raise BadSetting(f"LLAMAMESH_CLIENT_TLS_CA (--tls-ca): {why}") from None
    if settings.tls_cert and settings.tls_key:
        try:  # (an encrypted key: gRPC cannot use one either, so no password is asked for)
            ctx.load_cert_chain(settings.tls_cert, settings.tls_key, password=lambda: b"")
        except ssl.SSLError as exc:
            pair = f"{settings.tls_cert} and {settings.tls_key}"
            why = f"{pair} are not a PEM certificate and its key ({exc.reason or exc})"
            raise BadSetting(
                f"LLAMAMESH_CLIENT_TLS_CERT, LLAMAMESH_CLIENT_TLS_KEY (--tls-cert, --tls-key): {why}"
            ) from None


def rpc_error(err: grpc.RpcError, named: Callable[[str], str] = str) -> str:
    """A call the gateway refused (or could not be reached for), as one line: its status, its
    message and the fields it named (each through ``named``: a file's items as its lines)."""
    if not isinstance(err, grpc.aio.AioRpcError):
        return f"error: {err}"
    fields = [named(f) for f in field_violations(err)]
    return f"error: {err.code().name}: {named(err.details() or '')}" + (
        f" (fields: {', '.join(fields)})" if fields else ""
    )
