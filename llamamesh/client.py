"""The Python client internal services use: ``Client`` (asyncio) and ``SyncClient``.

Errors arrive as ``grpc.aio.AioRpcError`` / ``grpc.RpcError`` with the server's
status code; ``field_violations(err)`` lists the fields an INVALID_ARGUMENT named.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llamamesh.v1 import admin_pb2_grpc, batch_pb2_grpc, generation_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb

DEFAULT_ADDRESS = "127.0.0.1:50051"

Messages = Sequence[tuple[str, str]] | Sequence[pb.ChatMessage]


def build_request(
    prompt: str | None = None, messages: Messages | None = None, **fields: Any
) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt or (role, content) pairs plus any request fields."""
    req = pb.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    if prompt is not None:
        req.prompt = prompt
    for m in messages or ():
        req.messages.append(m if isinstance(m, pb.ChatMessage) else pb.ChatMessage(role=m[0], content=m[1]))
    return req


def field_violations(err: grpc.RpcError) -> list[str]:
    """The field names of a BadRequest detail in an error status (empty if none)."""
    st = rpc_status.from_call(err)  # type: ignore[arg-type]
    out: list[str] = []
    for d in st.details if st is not None else ():
        br = error_details_pb2.BadRequest()
        if d.Unpack(br):
            out.extend(v.field for v in br.field_violations)
    return out


def serving(address: str, service: str = "", timeout_s: float = 1.0) -> bool:
    """Whether the gateway at ``address`` answers SERVING for ``service`` ("" the server; a
    blocking check for scripts and tests); False when it does not answer."""
    with grpc.insecure_channel(address) as ch:
        try:
            check = health_pb2.HealthCheckRequest(service=service)
            got = health_pb2_grpc.HealthStub(ch).Check(check, timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(got.status == health_pb2.HealthCheckResponse.SERVING)


class Client:
    """Asyncio client. Cancelling the task iterating ``generate`` cancels the request server-side."""

    def __init__(self, address: str = DEFAULT_ADDRESS, channel: grpc.aio.Channel | None = None) -> None:
        self._channel = channel or grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self.batches = batch_pb2_grpc.BatchServiceStub(self._channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: str | None = None,
        messages: Messages | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, messages, **fields), timeout=timeout)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def complete(self, prompt: str | None = None, messages: Messages | None = None, **fields: Any) -> str:
        """The whole text of one generation."""
        return "".join([m.text async for m in self.generate(prompt, messages, **fields)])

    async def list_models(self) -> list[pb.Model]:
        return list((await self.stub.ListModels(pb.ListModelsRequest())).models)

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

    def __init__(self, address: str = DEFAULT_ADDRESS) -> None:
        self._channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self._channel)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def generate(
        self, prompt: str | None = None, messages: Messages | None = None, timeout: float | None = None, **fields: Any
    ) -> Iterator[pb.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, messages, **fields), timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, messages: Messages | None = None, **fields: Any) -> str:
        return "".join(m.text for m in self.generate(prompt, messages, **fields))
