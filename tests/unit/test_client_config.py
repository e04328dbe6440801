"""The Python client's channel config: retries on UNAVAILABLE before a first response, and the
load-balancing policy (round_robin watching each gateway's health)."""

from __future__ import annotations

import json

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
