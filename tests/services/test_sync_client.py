"""SyncClient offers every call of Client, with the same parameters, and answers as it does (an
in-process gateway over the fake engine; the blocking calls run in a thread beside its loop)."""

from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest
from grpc_health.v1 import health_pb2

from llamamesh.client import Client, SyncClient
from llamamesh.settings import ClientSettings
from llamamesh.v1 import batch_pb2 as bpb
from tests.redisproc import free_port
from tests.services.conftest import Stack

pytestmark = pytest.mark.timeout(30)

ASYNC_ONLY = {"__aenter__", "__aexit__"}
SYNC_ONLY = {"__enter__", "__exit__"}


def calls(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) or isinstance(v, classmethod)} - {"__init__"}


def test_every_call_of_client_is_on_sync_client_with_the_same_parameters() -> None:
    assert calls(Client) - ASYNC_ONLY == calls(SyncClient) - SYNC_ONLY
    for name in calls(Client) - ASYNC_ONLY | {"__init__"}:
        params = inspect.signature(getattr(Client, name)).parameters
        assert list(params) == list(inspect.signature(getattr(SyncClient, name)).parameters), name


async def test_sync_client_attributes_match_the_async_ones() -> None:
    a, s = Client("127.0.0.1:1"), SyncClient("127.0.0.1:1")
    try:
        assert {"stub", "batches", "admin"} <= set(vars(a)) and set(vars(a)) == set(vars(s))
    finally:
        await a.close()
        s.close()


async def test_sync_client_answers_as_the_async_one(stack: Stack) -> None:
    address = f"127.0.0.1:{stack.gateway.port}"
    ask = dict(max_tokens=5, temperature=0)

    async with Client(address) as c:
        await c.wait_ready(5)
        want = (await c.tokenize("a b c"), await c.health(), await c.list_models(), await c.complete("hi", **ask))

    def blocking() -> tuple[object, ...]:
        with SyncClient.from_settings(address, ClientSettings(connections=2)) as s:
            s.wait_ready(5)
            got = (s.tokenize("a b c"), s.health(), s.list_models(), s.complete("hi", **ask))
            texts = s.complete_n("hi", n=2, max_tokens=3)
            # Whether this gateway serves BatchService or not, the stub reached it.
            batches = s.batches.ListBatches.future(bpb.ListBatchesRequest(page_size=1)).code()
            assert batches in (grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED)
            return (*got, texts)

    *got, texts = await asyncio.to_thread(blocking)
    assert tuple(got) == want and len(want[0]) == 3 and want[1] == health_pb2.HealthCheckResponse.SERVING
    assert len(texts) == 2 and all(texts)


def test_sync_client_wait_ready_times_out_without_a_gateway() -> None:
    with SyncClient(f"127.0.0.1:{free_port()}", retries=0) as s:
        with pytest.raises(grpc.RpcError):
            s.health()
        with pytest.raises(TimeoutError, match="not SERVING"):
            s.wait_ready(0.5)


@pytest.mark.parametrize("cls", [Client, SyncClient])
async def test_bad_counts_and_a_channel_with_options_are_refused(cls: type) -> None:
    with pytest.raises(ValueError, match="connections"):
        cls("127.0.0.1:1", connections=0)
    with pytest.raises(ValueError, match="resume_attempts"):
        cls("127.0.0.1:1", resume_attempts=-1)
    if cls is Client:
        aio_channel = grpc.aio.insecure_channel("127.0.0.1:1")
        with pytest.raises(ValueError, match="either a channel"):
            Client(channel=aio_channel, api_key="k")
        await aio_channel.close()
    else:
        with grpc.insecure_channel("127.0.0.1:1") as channel, pytest.raises(ValueError, match="either a channel"):
            SyncClient(channel=channel, api_key="k")
