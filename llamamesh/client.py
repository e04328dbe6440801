"""The Python client internal services use: ``Client`` (asyncio) and ``SyncClient``.

Errors arrive as ``grpc.aio.AioRpcError`` / ``grpc.RpcError`` with the server's
status code; ``field_violations(err)`` lists the fields an INVALID_ARGUMENT named.

Connection options (keywords of ``Client``, ``SyncClient`` and ``serving``, or a ``ClientSettings``
through ``from_settings``): ``api_key`` is sent as ``authorization: Bearer <key>`` on every call (a
client interceptor; plaintext channels too). The channel uses TLS when ``tls_ca`` is set (the CA the
gateway's certificate is checked against), or ``tls=True`` (the system's CAs); ``tls_cert`` /
``tls_key`` add this client's certificate (mutual TLS); ``tls_server_name`` overrides the name the
gateway's certificate must carry (when dialling an address it is not issued for). A file that
cannot be read raises ValueError. A gateway refusing the handshake (an untrusted certificate
either way, a missing client certificate) fails calls with UNAVAILABLE.

Every call is retried on UNAVAILABLE before its first response message (``retries`` times, 3 by
default, with gRPC's exponential backoff from 0.2 s: a gateway stopping or restarting, a refused
connection), gRPC's own retry policy from the channel's service config. A ``generate`` stream that
breaks after that is resumed (``resume_attempts`` times in a row, 5 by default; 0 turns it off):
sent resumable, it is re-attached from what it delivered, through any gateway behind the channel,
so the caller's iterator sees one uninterrupted stream (llamamesh/resume.py).
``load_balancing="round_robin"`` spreads calls over every address the target resolves to
(``dns:///gateway-headless.ns:50051`` for a Kubernetes headless Service, or
``ipv4:10.0.0.1:50051,10.0.0.2:50051``), watching each gateway's health so one that turns
NOT_SERVING (draining) gets no new calls; the default, ``pick_first``, keeps one connection.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llamamesh.resume import resumed, resumed_sync
from llamamesh.settings import ClientSettings
from llamamesh.v1 import admin_pb2 as apb
from llamamesh.v1 import admin_pb2_grpc, batch_pb2_grpc, generation_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb

DEFAULT_ADDRESS = "127.0.0.1:50051"

Messages = Sequence[tuple[str, str]] | Sequence[pb.ChatMessage]


_FORMATS = ("json_schema", "json_object", "regex", "choice", "grammar")


def response_format(**given: Any) -> pb.ResponseFormat | None:
    """A ResponseFormat from at most one of ``json_schema`` (a dict, or JSON text), ``json_object``
    (True), ``regex``, ``choice`` (a list of strings) or ``grammar`` (EBNF); None if none is set."""
    set_ = {k: v for k, v in given.items() if v is not None and v is not False}
    if len(set_) > 1:
        raise ValueError(f"give one response format, got {sorted(set_)}")
    if not set_:
        return None
    ((kind, value),) = set_.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        return pb.ResponseFormat(choice=pb.Choice(options=list(value)))
    return pb.ResponseFormat(**{kind: value})


def build_request(
    prompt: str | None = None, messages: Messages | None = None, **fields: Any
) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt or (role, content) pairs plus any request fields. A response
    format can be given as one of ``json_schema=`` (a dict or JSON text), ``json_object=True``,
    ``regex=``, ``choice=[...]`` or ``grammar=`` (or as ``response_format=`` itself)."""
    fmt = response_format(**{k: fields.pop(k, None) for k in _FORMATS})
    if fmt is not None:
        fields["response_format"] = fmt
    req = pb.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    if prompt is not None:
        req.prompt = prompt
    for m in messages or ():
        req.messages.append(m if isinstance(m, pb.ChatMessage) else pb.ChatMessage(role=m[0], content=m[1]))
    return req


def by_sample(messages: Iterable[pb.GenerateResponse], n: int) -> list[str]:
    """The text of each of ``n`` samples (GenerateResponse.sample) from a response stream."""
    texts = [""] * n
    for m in messages:
        texts[m.sample] += m.text
    return texts


def _one_sample(fields: dict[str, Any]) -> None:
    if (fields.get("n") or 1) > 1:
        raise ValueError("complete() returns one text; use complete_n() for n > 1 samples")


def field_violations(err: grpc.RpcError) -> list[str]:
    """The field names of a BadRequest detail in an error status (empty if none)."""
    st = rpc_status.from_call(err)  # type: ignore[arg-type]
    out: list[str] = []
    for d in st.details if st is not None else ():
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            out.extend(v.field for v in br.field_violations)
    return out


@dataclass(frozen=True)
class Connection:
    """How a channel reaches the gateway (see the module's docstring)."""

    api_key: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    retries: int = 3
    load_balancing: str = "pick_first"

    @property
    def secure(self) -> bool:
        return bool(self.tls or self.tls_ca or self.tls_cert or self.tls_key)

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("the client's TLS certificate and key must be given together")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "CA"),
            private_key=_read(self.tls_key, "key"),
            certificate_chain=_read(self.tls_cert, "certificate"),
        )

    def options(self) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [("grpc.service_config", service_config(self.retries, self.load_balancing))]
        if self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return opts

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def aio_channel(self, address: str, own_connection: bool = False) -> grpc.aio.Channel:
        """``own_connection``: this channel's connections are its own, not shared with other channels to
        the same address (gRPC shares them by default)."""
        interceptors = _aio_interceptors(self.metadata())
        opts = self.options() + ([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])
        if self.secure:
            return grpc.aio.secure_channel(address, self.credentials(), opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, opts, interceptors=interceptors)

    def channel(self, address: str) -> grpc.Channel:
        if self.secure:
            ch = grpc.secure_channel(address, self.credentials(), self.options())
        else:
            ch = grpc.insecure_channel(address, self.options())
        extra = self.metadata()
        return grpc.intercept_channel(ch, _SyncMetadata(extra)) if extra else ch


LOAD_BALANCING = ("pick_first", "round_robin")
RETRIED_SERVICES = ("llamamesh.v1.GenerationService", "llamamesh.v1.BatchService", "llamamesh.v1.AdminService")


def service_config(retries: int, load_balancing: str) -> str:
    """The channel's gRPC service config: ``load_balancing`` (round_robin also watches each
    backend's overall health), and a retry policy on UNAVAILABLE for llamamesh's services."""
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing: {load_balancing!r} is not one of {', '.join(LOAD_BALANCING)}")
    if retries < 0:
        raise ValueError(f"retries: {retries} < 0")
    config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
    if load_balancing == "round_robin":
        config["healthCheckConfig"] = {"serviceName": ""}
    if retries:
        config["methodConfig"] = [{
            "name": [{"service": s} for s in RETRIED_SERVICES],
            "retryPolicy": {"maxAttempts": min(retries + 1, 5), "initialBackoff": "0.2s", "maxBackoff": "2s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }]  # fmt: skip
    return json.dumps(config)


def _read(path: str, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the client's TLS {what} {path}: {exc.strerror}") from exc


# --- the metadata interceptors (the API key on every call)


def _aio_interceptors(extra: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor] | None:
    if not extra:
        return None
    return [_AioUnaryUnary(extra), _AioUnaryStream(extra), _AioStreamUnary(extra), _AioStreamStream(extra)]


class _AioMetadata:
    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), *self._extra)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _SyncDetails(
    collections.namedtuple(
        "_SyncDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    """The call's details with more metadata (grpc's own is abstract)."""


class _SyncMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    def _details(self, d: Any) -> grpc.ClientCallDetails:
        return _SyncDetails(
            d.method, d.timeout, (*(d.metadata or ()), *self._extra), d.credentials,
            getattr(d, "wait_for_ready", None), getattr(d, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def serving(
    address: str,
    service: str = "",
    timeout_s: float = 1.0,
    *,
    api_key: str = "",
    tls: bool = False,
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    tls_server_name: str = "",
) -> bool:
    """Whether the gateway at ``address`` answers SERVING for ``service`` ("" the server; a
    blocking check for scripts and tests); False when it does not answer (a refused handshake
    included)."""
    conn = Connection(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name)
    with conn.channel(address) as ch:
        try:
            check = health_pb2.HealthCheckRequest(service=service)
            got = health_pb2_grpc.HealthStub(ch).Check(check, timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(got.status == health_pb2.HealthCheckResponse.SERVING)


class Client:
    """Asyncio client. Cancelling the task iterating ``generate`` cancels the request server-side."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        channel: grpc.aio.Channel | None = None,
        *,
        api_key: str = "",
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
        retries: int = 3,
        load_balancing: str = "pick_first",
        connections: int = 1,
        resume_attempts: int = 5,
    ) -> None:
        """``channel``: use this one as it is (then no connection option may be given).

        ``connections``: ``generate`` spreads its streams over this many connections, in turn. Each
        connection is served by one gateway process, so a client relaying hundreds of concurrent
        streams should open about one per 32 streams (``LLAMAMESH_GATEWAY_PROCESSES`` > 1 then serves
        them all); the other calls, and ``stub``, use the first."""
        conn = Connection(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name, retries, load_balancing)
        if channel is not None and (conn != Connection() or connections != 1):
            raise ValueError("Client: give either a channel or connection options, not both")
        if connections < 1:
            raise ValueError(f"Client: connections must be >= 1, got {connections}")
        if resume_attempts < 0:
            raise ValueError(f"Client: resume_attempts must be >= 0, got {resume_attempts}")
        self._resume_attempts = resume_attempts
        self._channels = [channel] if channel is not None else [
            conn.aio_channel(address, own_connection=connections > 1) for _ in range(connections)]  # fmt: skip
        self._channel = self._channels[0]
        self._streams = [generation_pb2_grpc.GenerationServiceStub(c) for c in self._channels]
        self._turn = itertools.count()
        self.stub = self._streams[0]
        self.batches = batch_pb2_grpc.BatchServiceStub(self._channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @classmethod
    def from_settings(cls, address: str, settings: ClientSettings, tls: bool = False) -> Client:
        """A client with ``settings``' API key and TLS files (``tls``: TLS even without a CA file)."""
        return cls(address, api_key=settings.api_key, tls=tls, tls_ca=settings.tls_ca, tls_cert=settings.tls_cert,
                   tls_key=settings.tls_key, tls_server_name=settings.tls_server_name, retries=settings.retries,
                   load_balancing=settings.load_balancing, connections=settings.connections,
                   resume_attempts=settings.resume_attempts)  # fmt: skip

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def generate(
        self,
        prompt: str | None = None,
        messages: Messages | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The responses of one request (``timeout``: for all of it, resumes included). Stopping
        early, or cancelling the iterating task, cancels the request."""
        stub = self._streams[next(self._turn) % len(self._streams)]
        request = build_request(prompt, messages, **fields)
        if self._resume_attempts:
            async for msg in resumed(stub, request, self._resume_attempts, timeout):
                yield msg
            return
        call = stub.Generate(request, timeout=timeout)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, messages: Messages | None = None, **fields: Any) -> str:
        """The whole text of one generation."""
        _one_sample(fields)
        return "".join([m.text async for m in self.generate(prompt, messages, **fields)])

    async def complete_n(
        self, prompt: str | None = None, messages: Messages | None = None, n: int = 2, **fields: Any
    ) -> list[str]:
        """The whole text of each of ``n`` parallel samples of one prompt (GenerateRequest.n), in order."""
        return by_sample([m async for m in self.generate(prompt, messages, n=n, **fields)], n)

    async def list_models(self) -> list[pb.Model]:
        return list((await self.stub.ListModels(pb.ListModelsRequest())).models)

    async def load_adapter(self, adapter: str, path: str, model: str = "", wait_s: int | None = None) -> list[str]:
        """Load a LoRA adapter (a PEFT folder on the workers) into the pool of ``model`` (AdminService:
        needs an admin key); the workers that serve it."""
        req = apb.LoadAdapterRequest(model=model, adapter=adapter, path=path, wait_s=wait_s)
        return list((await self.admin.LoadAdapter(req)).workers)

    async def unload_adapter(self, adapter: str, model: str = "", wait_s: int | None = None) -> list[str]:
        """Unload a run-time LoRA adapter from the pool of ``model`` (an admin key); the ready workers
        that still served it after ``wait_s`` (default 60; empty: it is gone)."""
        req = apb.UnloadAdapterRequest(model=model, adapter=adapter, wait_s=wait_s)
        return list((await self.admin.UnloadAdapter(req)).pending)

    async def tokenize(self, prompt: str | None = None, messages: Messages | None = None, model: str = "") -> list[int]:
        req = pb.TokenizeRequest(model=model)
        base = build_request(prompt, messages)
        if base.HasField("prompt"):
            req.prompt = base.prompt
        req.messages.extend(base.messages)
        return list((await self.stub.Tokenize(req)).token_ids)

    async def health(self, service: str = "") -> int:
        """The health status (health_pb2.HealthCheckResponse.ServingStatus) of the server or a service."""
        return int((await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll health until SERVING; raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if await self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway was not SERVING within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


class SyncClient:
    """Blocking client for scripts."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        api_key: str = "",
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
        retries: int = 3,
        load_balancing: str = "pick_first",
        resume_attempts: int = 5,
    ) -> None:
        conn = Connection(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name, retries, load_balancing)
        if resume_attempts < 0:
            raise ValueError(f"SyncClient: resume_attempts must be >= 0, got {resume_attempts}")
        self._resume_attempts = resume_attempts
        self._channel = conn.channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self._channel)

    @classmethod
    def from_settings(cls, address: str, settings: ClientSettings, tls: bool = False) -> SyncClient:
        """A client with ``settings``' API key and TLS files (``tls``: TLS even without a CA file)."""
        return cls(address, api_key=settings.api_key, tls=tls, tls_ca=settings.tls_ca, tls_cert=settings.tls_cert,
                   tls_key=settings.tls_key, tls_server_name=settings.tls_server_name, retries=settings.retries,
                   load_balancing=settings.load_balancing, resume_attempts=settings.resume_attempts)  # fmt: skip

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def generate(
        self, prompt: str | None = None, messages: Messages | None = None, timeout: float | None = None, **fields: Any
    ) -> Iterator[pb.GenerateResponse]:
        """As Client.generate."""
        request = build_request(prompt, messages, **fields)
        if self._resume_attempts:
            yield from resumed_sync(self.stub, request, self._resume_attempts, timeout)
            return
        call = self.stub.Generate(request, timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, messages: Messages | None = None, **fields: Any) -> str:
        _one_sample(fields)
        return "".join(m.text for m in self.generate(prompt, messages, **fields))

    def complete_n(
        self, prompt: str | None = None, messages: Messages | None = None, n: int = 2, **fields: Any
    ) -> list[str]:
        """The whole text of each of ``n`` parallel samples of one prompt, in order."""
        return by_sample(self.generate(prompt, messages, n=n, **fields), n)

    def list_models(self) -> list[pb.Model]:
        return list(self.stub.ListModels(pb.ListModelsRequest()).models)

    def load_adapter(self, adapter: str, path: str, model: str = "", wait_s: int | None = None) -> list[str]:
        """As Client.load_adapter."""
        req = apb.LoadAdapterRequest(model=model, adapter=adapter, path=path, wait_s=wait_s)
        return list(self.admin.LoadAdapter(req).workers)

    def unload_adapter(self, adapter: str, model: str = "", wait_s: int | None = None) -> list[str]:
        """As Client.unload_adapter."""
        req = apb.UnloadAdapterRequest(model=model, adapter=adapter, wait_s=wait_s)
        return list(self.admin.UnloadAdapter(req).pending)
