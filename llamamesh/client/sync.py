"""``SyncClient``: the blocking client of a gateway, for scripts; the same calls as ``Client``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from llamamesh.client.connection import DEFAULT_ADDRESS, Connection
from llamamesh.client.requests import Messages, build_request, by_sample, one_sample, tokenize_request
from llamamesh.client.resume import resumed_sync
from llamamesh.client.stubs import Stubs, options_of
from llamamesh.settings import ClientSettings
from llamamesh.v1 import admin_pb2 as apb
from llamamesh.v1 import generation_pb2 as pb


class SyncClient(Stubs[grpc.Channel]):
    """Blocking client. Errors are ``grpc.RpcError`` with the gateway's status code; the keywords,
    resumption included, are ``Client``'s."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        channel: grpc.Channel | None = None,
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
        """``channel`` and ``connections``: as in ``Client``."""
        conn = Connection(api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name, retries, load_balancing)
        self._open(
            "SyncClient",
            address,
            channel,
            conn,
            connections,
            resume_attempts,
            lambda a, own: conn.channel(a, own_connection=own),
        )

    @classmethod
    def from_settings(cls, address: str, settings: ClientSettings, tls: bool = False) -> SyncClient:
        """A client with ``settings``' API key and TLS files (``tls``: TLS even without a CA file)."""
        return cls(address, **options_of(settings, tls))

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def generate(
        self, prompt: str | None = None, messages: Messages | None = None, timeout: float | None = None, **fields: Any
    ) -> Iterator[pb.GenerateResponse]:
        """As ``Client.generate``: closing the iterator early cancels the request."""
        stub = self._next_stream()
        request = build_request(prompt, messages, **fields)
        if self._resume_attempts:
            yield from resumed_sync(stub, request, self._resume_attempts, timeout)
            return
        call = stub.Generate(request, timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | None = None, messages: Messages | None = None, **fields: Any) -> str:
        """The whole text of one generation."""
        one_sample(fields)
        return "".join(m.text for m in self.generate(prompt, messages, **fields))

    def complete_n(
        self, prompt: str | None = None, messages: Messages | None = None, n: int = 2, **fields: Any
    ) -> list[str]:
        """The whole text of each of ``n`` parallel samples of one prompt, in order."""
        return by_sample(self.generate(prompt, messages, n=n, **fields), n)

    def list_models(self) -> list[pb.Model]:
        """The models the gateway serves (adapters included)."""
        return list(self.stub.ListModels(pb.ListModelsRequest()).models)

    def load_adapter(self, adapter: str, path: str, model: str = "", wait_s: int | None = None) -> list[str]:
        """As ``Client.load_adapter``."""
        req = apb.LoadAdapterRequest(model=model, adapter=adapter, path=path, wait_s=wait_s)
        return list(self.admin.LoadAdapter(req).workers)

    def unload_adapter(self, adapter: str, model: str = "", wait_s: int | None = None) -> list[str]:
        """As ``Client.unload_adapter``."""
        req = apb.UnloadAdapterRequest(model=model, adapter=adapter, wait_s=wait_s)
        return list(self.admin.UnloadAdapter(req).pending)

    def tokenize(self, prompt: str | None = None, messages: Messages | None = None, model: str = "") -> list[int]:
        """As ``Client.tokenize``."""
        return list(self.stub.Tokenize(tokenize_request(prompt, messages, model)).token_ids)

    def health(self, service: str = "") -> int:
        """As ``Client.health``."""
        return int(self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll health until SERVING; raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway was not SERVING within {timeout_s:.0f} s")
            time.sleep(0.2)  # the poll's period
