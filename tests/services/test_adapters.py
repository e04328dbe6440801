"""LoRA adapters through the gateway, the queue and a worker (the fake engine: an adapter shifts its
tokens, so its output differs from the base model's and is the same each run): a worker's own
adapters (LLAMAMESH_WORKER_ADAPTERS), GenerateRequest.adapter and model "<model>:<adapter>", ListModels,
NOT_FOUND for an adapter nobody serves, and AdminService LoadAdapter / UnloadAdapter at run time."""

from __future__ import annotations

import grpc
import pytest

from llamamesh.client import field_violations
from llamamesh.settings import BreakerSettings, GatewaySettings, WorkerSettings
from llamamesh.v1 import admin_pb2 as apb
from llamamesh.v1 import generation_pb2 as pb
from tests.services.conftest import Config, Stack, running
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


def node(n_workers: int = 2, adapters: str = "sql=/adapters/sql", adapter_root: str = "", step_s: float = 0) -> Config:
    """A gateway reading heartbeats every 50 ms, and ``n_workers`` workers w0, w1... of pool cpu."""
    workers = tuple(
        WorkerSettings(
            pool="cpu",
            model="tiny",
            engine="fake",
            consumer=f"w{i}",
            heartbeat_s=0.05,
            adapters=adapters,
            adapter_root=adapter_root,
            fake_step_s=step_s,
        )
        for i in range(n_workers)
    )
    return Config(
        gateway=GatewaySettings(port=0, models="tiny=cpu"),
        breaker=BreakerSettings(probe_interval_s=0.05),
        workers=workers,
        block_ms=50,
        ready_s=10,
    )


async def models(n: Stack) -> dict[str, pb.Model]:
    return {m.id: m for m in (await n.stub.ListModels(pb.ListModelsRequest())).models}


async def tokens(n: Stack, **fields: object) -> list[int]:
    return [
        t
        async for m in n.stub.Generate(pb.GenerateRequest(prompt="same words", max_tokens=6, **fields))
        for t in m.token_ids
    ]


async def test_an_adapter_changes_the_output_the_same_way_each_run_and_is_listed() -> None:
    async with running(node()) as n:
        await until(lambda: _has(n, "tiny:sql"), 10, "ListModels to list tiny:sql")
        listed = (await models(n))["tiny:sql"]
        assert (listed.base, listed.adapter, listed.pool) == ("tiny", "sql", "cpu")
        base = await tokens(n)
        with_sql = await tokens(n, adapter="sql")
        assert with_sql != base and len(with_sql) == 6
        assert await tokens(n, adapter="sql") == with_sql  # the same each run
        assert await tokens(n, model="tiny:sql") == with_sql  # model "<model>:<adapter>" alike


async def _ready(n: Stack) -> bool:
    """The gateway sees every worker of the node ready (LoadAdapter waits only for the ready ones)."""
    (pool,) = (await n.admin.ListBackends(apb.ListBackendsRequest())).backends
    return sum(w.state == "ready" for w in pool.workers) == len(n.workers)


async def _has(n: Stack, model_id: str) -> bool:
    return model_id in await models(n)


async def _lacks(n: Stack, model_id: str) -> bool:
    return model_id not in await models(n)


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"adapter": "nope"}, grpc.StatusCode.NOT_FOUND, None),
        ({"model": "tiny:nope"}, grpc.StatusCode.NOT_FOUND, None),
        ({"model": "other:sql"}, grpc.StatusCode.NOT_FOUND, None),
        ({"adapter": "a/b"}, grpc.StatusCode.INVALID_ARGUMENT, "adapter"),
    ],
)
async def test_an_adapter_nobody_serves_is_not_found(fields: dict, code: grpc.StatusCode, field: str | None) -> None:
    async with running(node(n_workers=1)) as n:
        await until(lambda: _has(n, "tiny:sql"), 10, "the worker's heartbeat")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await tokens(n, **fields)
        assert ei.value.code() == code, ei.value.details()
        if field:
            assert field_violations(ei.value) == [field]


async def test_load_and_unload_an_adapter_at_run_time_through_admin_service() -> None:
    async with running(node(adapters="")) as n:
        await until(lambda: _ready(n), 10, "the gateway to see both workers")
        loaded = await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="fr", path="/adapters/fr"))
        assert sorted(loaded.workers) == ["w0", "w1"]  # every ready worker, before it returns
        assert "tiny:fr" in await models(n)
        fr = await tokens(n, adapter="fr")
        assert fr != await tokens(n) and fr == await tokens(n, adapter="fr")
        again = await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="fr", path="/adapters/fr"))
        assert sorted(again.workers) == ["w0", "w1"]  # idempotent
        unloaded = await n.admin.UnloadAdapter(apb.UnloadAdapterRequest(model="tiny", adapter="fr"))
        assert list(unloaded.pending) == []  # it returns once the workers dropped it
        assert "tiny:fr" not in await models(n)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await tokens(n, adapter="fr")
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await n.admin.UnloadAdapter(apb.UnloadAdapterRequest(model="tiny", adapter="fr"))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_an_adapter_no_worker_can_load_is_refused_and_not_kept() -> None:
    async with running(node(n_workers=1, adapters="")) as n:
        await until(lambda: _ready(n), 10, "the gateway to see the worker")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="bad", path="missing/bad"))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(ei.value) == ["path"]
        assert "no folder" in (ei.value.details() or "")
        assert await n.queue.adapters("cpu") == {}
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="a:b", path="/x"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(bad.value) == ["adapter"]
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="nope", adapter="a", path="/x"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_run_time_adapters_stay_under_the_workers_adapter_root() -> None:
    async with running(node(n_workers=1, adapters="", adapter_root="/adapters")) as n:
        await until(lambda: _ready(n), 10, "the gateway to see the worker")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="x", path="/adapters/../etc"))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(ei.value) == ["path"]
        assert "not under LLAMAMESH_WORKER_ADAPTER_ROOT" in (ei.value.details() or "")
        ok = await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="x", path="/adapters/x"))
        assert list(ok.workers) == ["w0"]


async def test_load_returns_at_its_wait_with_the_workers_still_loading_and_refuses_a_bad_path() -> None:
    async with running(node(n_workers=1, adapters="")) as n:
        await until(lambda: _ready(n), 10, "the gateway to see the worker")
        first = await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="slow", path="/a/s", wait_s=0))
        assert list(first.workers) + list(first.pending) == ["w0"]  # registered; the worker loads it anyway
        await until(lambda: _has(n, "tiny:slow"), 10, "the worker to load it after the call returned")
        for path in ("", "x" * 5000, "/a\x00b"):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="p", path=path))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_violations(ei.value) == ["path"]


async def test_an_adapter_registered_again_from_another_folder_is_swapped_on_every_worker() -> None:
    async with running(node(adapters="")) as n:
        await until(lambda: _ready(n), 10, "the gateway to see both workers")
        await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="x", path="/a/1"))
        again = await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="x", path="/a/2"))
        assert sorted(again.workers) == ["w0", "w1"] and not again.pending  # it returns once they swapped
        assert all(w._engine._adapters.get("x") == "/a/2" for w in n.workers)  # type: ignore[attr-defined]
        assert "tiny:x" in await models(n)


async def test_unload_says_which_workers_still_serve_an_adapter_in_use_and_they_drop_it_after() -> None:
    async with running(node(n_workers=1, adapters="", step_s=0.01)) as n:
        await until(lambda: _ready(n), 10, "the gateway to see the worker")
        await n.admin.LoadAdapter(apb.LoadAdapterRequest(model="tiny", adapter="fr", path="/adapters/fr"))
        call = n.stub.Generate(pb.GenerateRequest(prompt="a long one", max_tokens=4000, adapter="fr"))
        assert (await call.read()).token_ids  # running with the adapter
        unloaded = await n.admin.UnloadAdapter(apb.UnloadAdapterRequest(model="tiny", adapter="fr", wait_s=1))
        assert list(unloaded.pending) == ["w0"]  # in use: the worker keeps it while the request runs
        assert "tiny:fr" in await models(n)
        assert (await call.read()).token_ids  # and the request goes on
        call.cancel()
        await until(lambda: _lacks(n, "tiny:fr"), 10, "the worker to drop fr once its request ended")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await tokens(n, adapter="fr")
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
