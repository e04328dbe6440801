"""The Python client's channel config: retries on UNAVAILABLE before a first response, the
load-balancing policy (round_robin watching each gateway's health), and its connections."""

from __future__ import annotations

import json

import grpc
import pytest

from llamamesh.client import RETRIED_SERVICES, Connection, service_config

pytestmark = pytest.mark.timeout(10)


def test_default_retries_unavailable_with_backoff_on_every_llamamesh_service() -> None:
    config = json.loads(service_config(3, "pick_first"))
    assert config["loadBalancingConfig"] == [{"pick_first": {}}]
    (method,) = config["methodConfig"]
    assert [n["service"] for n in method["name"]] == list(RETRIED_SERVICES)
    policy = method["retryPolicy"]
    assert policy["maxAttempts"] == 4 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert policy["initialBackoff"] == "0.2s" and policy["backoffMultiplier"] == 2
    assert "healthCheckConfig" not in config


def test_round_robin_watches_health_and_zero_retries_means_none() -> None:
    config = json.loads(service_config(0, "round_robin"))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ""}
    assert "methodConfig" not in config
    assert json.loads(service_config(99, "pick_first"))["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 5


@pytest.mark.parametrize(("retries", "lb", "error"), [(-1, "pick_first", "retries"), (3, "random", "load_balancing")])
def test_bad_options_are_refused(retries: int, lb: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        service_config(retries, lb)


async def test_a_round_robin_channel_over_several_addresses_is_accepted_by_grpc() -> None:
    channel = Connection(load_balancing="round_robin").aio_channel("ipv4:127.0.0.1:1,127.0.0.1:2")
    await channel.close()


async def test_generate_streams_take_the_clients_connections_in_turn() -> None:
    """Each connection is served by one gateway process: with connections=3, six streams arrive over
    three distinct connections (peers), two each; the other calls use the first connection."""
    import grpc

    from llamamesh.client import Client
    from llamamesh.v1 import generation_pb2 as pb
    from llamamesh.v1 import generation_pb2_grpc

    peers: list[str] = []

    class Service(generation_pb2_grpc.GenerationServiceServicer):
        async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
            peers.append(context.peer())
            yield pb.GenerateResponse(text="x", finish_reason=pb.FINISH_REASON_LENGTH)

        async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
            peers.append(context.peer())
            return pb.ListModelsResponse()

    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Client(f"127.0.0.1:{port}", retries=0, connections=3) as c:
            for _ in range(6):
                assert await c.complete("hi") == "x"
            await c.list_models()
        streams, other = peers[:6], peers[6]
        assert len(set(streams)) == 3 and all(streams.count(p) == 2 for p in streams)
        assert other == streams[0]
        peers.clear()
        async with Client(f"127.0.0.1:{port}", retries=0) as c:  # the default: one connection
            for _ in range(3):
                await c.complete("hi")
        assert len(set(peers)) == 1
    finally:
        await server.stop(None)


async def test_connections_must_be_positive_and_not_given_with_a_channel() -> None:
    from llamamesh.client import Client

    with pytest.raises(ValueError, match="connections"):
        Client("127.0.0.1:1", connections=0)
    channel = Connection().aio_channel("127.0.0.1:1")
    with pytest.raises(ValueError, match="either a channel"):
        Client(channel=channel, connections=2)
    await channel.close()


async def test_a_message_past_grpcs_default_4_mib_reaches_the_client() -> None:
    """A batch result with logprobs can pass 4 MiB: the client's channel takes up to 64 MiB."""
    big = b"x" * (5 << 20)

    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return big

    server = grpc.aio.server(options=[("grpc.max_send_message_length", -1)])
    handler = grpc.method_handlers_generic_handler("t.T", {"Big": grpc.unary_unary_rpc_method_handler(answer)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Connection(retries=0).aio_channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary("/t.T/Big")(b"", timeout=10) == big
    finally:
        await server.stop(0)
