from __future__ import annotations

import pytest

from llamamesh.settings import Settings

pytestmark = pytest.mark.timeout(10)


def test_env_maps_one_to_one_to_fields() -> None:
    s = Settings.from_env({
        "LLAMAMESH_REDIS_URL": "redis://h:1/0",
        "LLAMAMESH_WORKER_MAX_INFLIGHT": "7",
        "LLAMAMESH_WORKER_FAKE_STEP_S": "0.5",
        "LLAMAMESH_GATEWAY_MODELS": "a=gpu, b=cpu",
        "UNRELATED": "x",
    })
    assert s.redis.url == "redis://h:1/0"
    assert s.worker.max_inflight == 7 and s.worker.fake_step_s == 0.5
    assert [(m.id, m.pool, m.default) for m in s.gateway.model_table()] == [("a", "gpu", True), ("b", "cpu", False)]


def test_round_trip_through_the_environment() -> None:
    s = Settings.from_env({}).with_overrides(worker={"engine": "fake", "threads": 3}, gateway={"port": None})
    assert Settings.from_env(s.to_env()) == s
    assert s.gateway.port == 50051


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ValueError, match="LLAMAMESH_WORKER_MAX_INFLIGHT"):
        Settings.from_env({"LLAMAMESH_WORKER_MAX_INFLIGHT": "many"})
    with pytest.raises(ValueError, match="LLAMAMESH_GATEWAY_MODELS"):
        Settings.from_env({"LLAMAMESH_GATEWAY_MODELS": "nopool"}).gateway.model_table()


def test_threads_default_leaves_a_core_free() -> None:
    assert Settings.from_env({}).worker.torch_threads() >= 1
    assert Settings.from_env({"LLAMAMESH_WORKER_THREADS": "4"}).worker.torch_threads() == 4
