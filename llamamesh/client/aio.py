"""``Client``: the asyncio client of a gateway."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from llamamesh.client.connection import DEFAULT_ADDRESS, Connection
from llamamesh.client.requests import Messages, build_request, by_sample, one_sample, tokenize_request
from llamamesh.client.resume import resumed
from llamamesh.client.stubs import Stubs, options_of
from llamamesh.settings import ClientSettings
from llamamesh.v1 import admin_pb2 as apb
from llamamesh.v1 import generation_pb2 as pb


class Client(Stubs[grpc.aio.Channel]):
    """Asyncio client. Errors are ``grpc.aio.AioRpcError`` with the gateway's status code.

    The connection keywords (API key, TLS, ``retries``, ``load_balancing``) are ``Connection``'s. A
    ``generate`` stream that breaks is resumed (``resume_attempts`` times in a row and for at least
    10 s, 5 by default; 0 turns it off): re-attached from what it delivered, through any gateway behind the channel, so
    the caller's iterator sees one uninterrupted stream (``llamamesh.client.resume``).
    """

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
        self._open(
            "Client",
            address,
            channel,
            conn,
            connections,
            resume_attempts,
            lambda a, own: conn.aio_channel(a, own_connection=own),
        )

    @classmethod
    def from_settings(cls, address: str, settings: ClientSettings, tls: bool = False) -> Client:
        """A client with ``settings``' API key and TLS files (``tls``: TLS even without a CA file)."""
        return cls(address, **options_of(settings, tls))

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
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The responses of one request (``timeout``: for all of it, resumes included). Stopping
        early, or cancelling the iterating task, cancels the request (at once when the caller closes
        this generator, e.g. with ``contextlib.aclosing``; else when it is collected)."""
        stub = self._next_stream()
        request = build_request(prompt, messages, **fields)
        if self._resume_attempts:
            async with aclosing(resumed(stub, request, self._resume_attempts, timeout)) as msgs:
                async for msg in msgs:
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
        one_sample(fields)
        return "".join([m.text async for m in self.generate(prompt, messages, **fields)])

    async def complete_n(
        self, prompt: str | None = None, messages: Messages | None = None, n: int = 2, **fields: Any
    ) -> list[str]:
        """The whole text of each of ``n`` parallel samples of one prompt (GenerateRequest.n), in order."""
        return by_sample([m async for m in self.generate(prompt, messages, n=n, **fields)], n)

    async def list_models(self) -> list[pb.Model]:
        """The models the gateway serves (adapters included)."""
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
        """The token ids of a prompt, or of chat messages with the model's template applied."""
        return list((await self.stub.Tokenize(tokenize_request(prompt, messages, model))).token_ids)

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
