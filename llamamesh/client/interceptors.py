"""The client's metadata interceptors: extra metadata (the API key) on every call of a channel,
asyncio or blocking."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import grpc

Metadata = tuple[tuple[str, str], ...]

# grpc ships no type stubs: its interceptor bases are Any to mypy, hence the ignores on subclassing.


def aio_interceptors(extra: Metadata) -> list[grpc.aio.ClientInterceptor] | None:
    """Interceptors adding ``extra`` to every kind of call of an asyncio channel (None if empty)."""
    if not extra:
        return None
    return [_AioUnaryUnary(extra), _AioUnaryStream(extra), _AioStreamUnary(extra), _AioStreamStream(extra)]


class _AioMetadata:
    def __init__(self, extra: Metadata) -> None:
        self._extra = extra

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), *self._extra)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


_DetailsFields = collections.namedtuple(
    "_DetailsFields", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


class _SyncDetails(_DetailsFields, grpc.ClientCallDetails):  # type: ignore[misc]
    """The call's details with more metadata (grpc's own is abstract)."""


class SyncMetadata(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds ``extra`` to every call of a blocking channel (``grpc.intercept_channel``)."""

    def __init__(self, extra: Metadata) -> None:
        self._extra = extra

    def _details(self, d: Any) -> grpc.ClientCallDetails:
        return _SyncDetails(
            d.method,
            d.timeout,
            (*(d.metadata or ()), *self._extra),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)
