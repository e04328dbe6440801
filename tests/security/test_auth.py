"""Authentication and ownership on a real secured node (TLS gateway + tenants file, fake-engine
worker, redis-server): who may call, as whom, and what each tenant can see of the others."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import structlog
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2

from llamamesh.client import Client, field_violations
from llamamesh.settings import AuthSettings, GatewaySettings
from llamamesh.v1 import admin_pb2
from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.test_node import grpcurl
from tests.redisproc import RedisProcess
from tests.security.conftest import PKI
from tests.security.secured import SecuredNode, Tenants, create_key, key_id, start_node
from tests.stacks import gateway_in_process
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
ALL_RPCS = [
    "llamamesh.v1.GenerationService/Generate",
    "llamamesh.v1.GenerationService/Attach",
    "llamamesh.v1.GenerationService/Cancel",
    "llamamesh.v1.GenerationService/ListModels",
    "llamamesh.v1.GenerationService/Tokenize",
    "llamamesh.v1.BatchService/BatchGenerate",
    "llamamesh.v1.BatchService/GetBatch",
    "llamamesh.v1.BatchService/ListBatches",
    "llamamesh.v1.BatchService/CancelBatch",
    "llamamesh.v1.BatchService/StreamBatchResults",
    "llamamesh.v1.AdminService/ListBackends",
]


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, security_redis: RedisProcess, pki: PKI
) -> Iterator[tuple[SecuredNode, Tenants]]:
    yield from start_node(
        tmp_path_factory,
        security_redis,
        pki,
        "secured",
        {
            "alpha": {"limits": {"max_priority": 5}},
            "beta": {},
            "ops": {"admin": True},
            "narrow": {"limits": {"pools": "gpu"}},
        },
        env={"LLAMAMESH_WORKER_FAKE_STEP_S": "0.005"},
    )


def code_of(exc: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return exc.value.code()


async def answer(client: Client, **fields: object) -> tuple[str, list[pb.GenerateResponse]]:
    msgs = [m async for m in client.generate(**fields)]  # type: ignore[arg-type]
    return "".join(m.text for m in msgs), msgs


async def refused_soon(c: Client, within_s: float = 10) -> grpc.aio.AioRpcError:
    """The error of the first ListModels refused within ``within_s`` (the gateway reads its
    tenants file again within a second)."""

    async def refusal() -> grpc.aio.AioRpcError | None:
        try:
            await c.list_models()
        except grpc.aio.AioRpcError as err:
            return err
        return None

    return await until(refusal, within_s, "a refusal (the gateway still accepts)", poll_s=0.1)


def run_grpcurl(node: SecuredNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([grpcurl(), "-cacert", node.ca, *args], capture_output=True, text=True, timeout=60)


# --- authentication


def health_protoset(folder: Path) -> str:
    """grpc.health.v1 as a protoset file, for grpcurl without reflection (which needs a key)."""
    fp = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(fp)
    path = folder / "health.protoset"
    path.write_bytes(descriptor_pb2.FileDescriptorSet(file=[fp]).SerializeToString())
    return str(path)


def test_grpcurl_without_a_key_gets_unauthenticated_on_every_rpc_but_health(
    secured: tuple[SecuredNode, Tenants], tmp_path: Path
) -> None:
    node, tenants = secured
    protos = [
        "-import-path",
        str(REPO / "proto"),
        "-proto",
        "llamamesh/v1/generation.proto",
        "-proto",
        "llamamesh/v1/batch.proto",
        "-proto",
        "llamamesh/v1/admin.proto",
    ]
    for method in ALL_RPCS:
        for header in ([], ["-H", "x-llamamesh-tenant: alpha"], ["-H", "authorization: Bearer lm_nope_nope"]):
            got = run_grpcurl(node, *protos, *header, "-d", "{}", node.address, method)
            assert got.returncode != 0 and "Code: Unauthenticated" in got.stderr, (method, header, got.stderr)
    health = run_grpcurl(node, "-protoset", health_protoset(tmp_path), node.address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    # Reflection needs an identity too; with a key grpcurl works as usual.
    assert "Unauthenticated" in run_grpcurl(node, node.address, "list").stderr
    key = ["-H", f"authorization: Bearer {tenants.keys['alpha']}"]
    listed = run_grpcurl(node, *key, node.address, "list")
    assert listed.returncode == 0 and "llamamesh.v1.GenerationService" in listed.stdout, listed.stderr
    models = run_grpcurl(node, *key, node.address, "llamamesh.v1.GenerationService/ListModels")
    assert models.returncode == 0 and "smollm2-135m-instruct" in models.stdout, models.stderr


async def test_no_key_bad_key_and_revoked_key_are_unauthenticated(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    for key in ("", "lm_0123456789ab_wrong", "not-even-a-key", tenants.keys["alpha"] + "x"):
        async with node.client(key) as c:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.list_models()
            assert code_of(exc) == grpc.StatusCode.UNAUTHENTICATED, key
    fresh = create_key(tenants.file, "alpha")
    async with node.client(fresh) as c:

        async def accepted() -> bool:  # a new key counts once the gateway read the file again (within a second)
            try:
                assert [m.id for m in await c.list_models()] == ["smollm2-135m-instruct"]
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAUTHENTICATED:
                    raise
                return False
            return True

        await until(accepted, 10, "the gateway to accept the new key", poll_s=0.1)
        tenants.revoke(fresh)  # the gateway reads the file again within a second, no restart
        refused = await refused_soon(c)
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in (refused.details() or "")


async def test_admin_service_needs_an_admin_identity(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    async with node.client(tenants.keys["alpha"]) as c:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await c.admin.ListBackends(admin_pb2.ListBackendsRequest())
        assert code_of(exc) == grpc.StatusCode.PERMISSION_DENIED
    async with node.client(tenants.keys["ops"]) as c:
        got = await c.admin.ListBackends(admin_pb2.ListBackendsRequest())
        assert [b.pool for b in got.backends] == ["cpu"]


def test_keys_never_reach_the_logs_and_each_decision_is_one_line(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    # Make sure some decisions happened (this test may run alone).
    run_grpcurl(node, "-H", f"authorization: Bearer {tenants.keys['beta']}", node.address, "list")
    run_grpcurl(node, "-H", "authorization: Bearer lm_0123456789ab_wrong", node.address, "list")
    text = node.log("gateway")
    for key in tenants.keys.values():
        assert key not in text and key.split("_", 2)[2] not in text
    decisions = [json.loads(line) for line in text.splitlines() if '"auth_decided"' in line]
    allowed = [d for d in decisions if d["outcome"] == "allowed" and d["tenant"] == "beta"]
    assert allowed and allowed[0]["key_id"] == key_id(tenants.keys["beta"]) and allowed[0]["method"]
    assert any(d["outcome"] == "unauthenticated" for d in decisions)


async def test_mutual_tls_identity_maps_to_a_tenant(pki: PKI, tmp_path: Path) -> None:
    """A client certificate the tenants file lists authenticates as its tenant without a key; one
    it does not list is UNAUTHENTICATED."""
    auth = tmp_path / "tenants.json"
    create_key(auth, "alpha")
    doc = json.loads(auth.read_text())
    doc["tenants"]["alpha"]["certificates"] = ["tenant-a"]
    auth.write_text(json.dumps(doc))
    settings = GatewaySettings(
        port=0, tls_cert=str(pki.server.cert), tls_key=str(pki.server.key), tls_client_ca=str(pki.ca.cert)
    )
    opts = {"tls_ca": str(pki.ca.cert), "tls_cert": str(pki.client.cert), "tls_key": str(pki.client.key)}
    async with gateway_in_process(settings, auth=AuthSettings(file=str(auth))) as gw:
        with structlog.testing.capture_logs() as logs:
            async with Client(f"127.0.0.1:{gw.port}", **opts) as c:
                assert [m.id for m in await c.list_models()] == ["smollm2-135m-instruct"]
        decided = [e for e in logs if e["event"] == "auth_decided"]
        assert decided and decided[0]["tenant"] == "alpha" and decided[0]["via"] == "certificate"
        doc["tenants"]["alpha"]["certificates"] = ["someone-else"]
        auth.write_text(json.dumps(doc))
        os.utime(auth, (time.time() + 5, time.time() + 5))  # a new mtime even within one tick
        async with Client(f"127.0.0.1:{gw.port}", **opts) as c:
            refused = await refused_soon(c)
            assert refused.code() == grpc.StatusCode.UNAUTHENTICATED


# --- ownership


async def test_another_tenant_cannot_attach_cancel_or_see_a_request(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    rid = f"shared-{uuid.uuid4().hex[:6]}"
    only_alpha = f"alpha-only-{uuid.uuid4().hex[:6]}"
    async with node.client(tenants.keys["alpha"]) as a, node.client(tenants.keys["beta"]) as b:
        stream = a.stub.Generate(
            pb.GenerateRequest(request_id=only_alpha, prompt="alpha's question", max_tokens=200, resumable=True)
        )
        first = await stream.read()
        assert first.request_id == only_alpha and first.token_ids
        for header in ((), (("x-llamamesh-tenant", "alpha"),)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _m in b.stub.Attach(pb.AttachRequest(request_id=only_alpha), metadata=header):
                    pass
            assert code_of(exc) == grpc.StatusCode.NOT_FOUND  # the same answer as for an id nobody used
            with pytest.raises(grpc.aio.AioRpcError) as never:
                async for _m in b.stub.Attach(pb.AttachRequest(request_id="never-used"), metadata=header):
                    pass
            assert (exc.value.details() or "").replace(only_alpha, "ID") == (never.value.details() or "").replace(
                "never-used", "ID"
            )
            await b.stub.Cancel(pb.CancelRequest(request_id=only_alpha), metadata=header)  # no error, no effect
        rest = [m async for m in stream]
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH  # not cancelled by beta
        assert sum(len(m.token_ids) for m in [first, *rest]) == 200
        again = [m async for m in a.stub.Attach(pb.AttachRequest(request_id=only_alpha, offset=190))]
        assert sum(len(m.token_ids) for m in again) == 10 and again[-1].request_id == only_alpha
        # One id, two tenants: each its own request, independently.
        _, mine = await answer(a, request_id=rid, prompt="alpha's", max_tokens=7)
        _, theirs = await answer(b, request_id=rid, prompt="beta's", max_tokens=5)
        assert [sum(len(m.token_ids) for m in x) for x in (mine, theirs)] == [7, 5]
        attached = [m async for m in b.stub.Attach(pb.AttachRequest(request_id=rid))]
        assert sum(len(m.token_ids) for m in attached) == 5 and attached[-1].request_id == rid


async def test_a_reused_request_id_with_another_request_is_already_exists(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    rid = f"dup-{uuid.uuid4().hex[:6]}"
    async with node.client(tenants.keys["alpha"]) as a:
        text, _ = await answer(a, request_id=rid, prompt="one prompt", max_tokens=8, temperature=0.0)
        again, _ = await answer(a, request_id=rid, prompt="one prompt", max_tokens=8, temperature=0.0)
        assert again == text  # the identical request: an idempotent retry
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await answer(a, request_id=rid, prompt="another prompt", max_tokens=8, temperature=0.0)
        assert code_of(exc) == grpc.StatusCode.ALREADY_EXISTS and rid in (exc.value.details() or "")


async def test_caller_ids_cannot_name_internal_ids(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    async with node.client(tenants.keys["alpha"]) as a:
        for bad in ("x~1", "alpha/x", "b~batch~0"):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await answer(a, request_id=bad, prompt="p", max_tokens=2)
            assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT and field_violations(exc.value) == ["request_id"]
        # "X.1" is a caller id like any other, not X's first failover attempt
        rid = f"r{uuid.uuid4().hex[:6]}"
        await answer(a, request_id=rid, prompt="first", max_tokens=3)
        _, msgs = await answer(a, request_id=f"{rid}.1", prompt="second", max_tokens=4)
        assert sum(len(m.token_ids) for m in msgs) == 4


def batch(batch_id: str, *prompts: str) -> bpb.BatchGenerateRequest:
    items = [
        bpb.BatchItem(custom_id=f"i{n}", request=pb.GenerateRequest(prompt=p, max_tokens=3))
        for n, p in enumerate(prompts)
    ]
    return bpb.BatchGenerateRequest(batch_id=batch_id, items=items)


async def test_another_tenant_cannot_see_or_touch_a_batch(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    async with node.client(tenants.keys["alpha"]) as a, node.client(tenants.keys["beta"]) as b:
        made = await a.batches.BatchGenerate(batch(bid, "one", "two"))
        assert made.batch_id == bid and made.owner == "alpha"
        for header in ((), (("x-llamamesh-tenant", "alpha"),)):
            for call, req in (
                (b.batches.GetBatch, bpb.GetBatchRequest(batch_id=bid)),
                (b.batches.CancelBatch, bpb.CancelBatchRequest(batch_id=bid)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call(req, metadata=header)
                assert code_of(exc) == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _r in b.batches.StreamBatchResults(
                    bpb.StreamBatchResultsRequest(batch_id=bid), metadata=header
                ):
                    pass
            assert code_of(exc) == grpc.StatusCode.NOT_FOUND
            listed = await b.batches.ListBatches(bpb.ListBatchesRequest(), metadata=header)
            assert bid not in [x.batch_id for x in listed.batches]
        # beta's own batch under the same id, with other items: its own, not "exists"
        theirs = await b.batches.BatchGenerate(batch(bid, "three"))
        assert theirs.batch_id == bid and theirs.owner == "beta" and theirs.counts.total == 1
        # alpha's results are alpha's
        results = [r async for r in a.batches.StreamBatchResults(bpb.StreamBatchResultsRequest(batch_id=bid))]
        assert sorted(r.custom_id for r in results) == ["i0", "i1"] and all(r.batch_id == bid for r in results)
        mine = await a.batches.ListBatches(bpb.ListBatchesRequest())
        assert bid in [x.batch_id for x in mine.batches]
        # a different batch under alpha's taken id: ALREADY_EXISTS; the same one: itself
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await a.batches.BatchGenerate(batch(bid, "other"))
        assert code_of(exc) == grpc.StatusCode.ALREADY_EXISTS and bid in (exc.value.details() or "")
        same = await a.batches.BatchGenerate(batch(bid, "one", "two"))
        assert same.batch_id == bid and same.counts.total == 2


# --- privilege


async def test_priority_and_pools_come_from_the_tenant(secured: tuple[SecuredNode, Tenants]) -> None:
    node, tenants = secured
    async with node.client(tenants.keys["alpha"]) as a:
        await answer(a, prompt="p", max_tokens=2, priority=5)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await answer(a, prompt="p", max_tokens=2, priority=6)
        assert code_of(exc) == grpc.StatusCode.PERMISSION_DENIED and "LLAMAMESH_LIMITS_MAX_PRIORITY" in (
            exc.value.details() or ""
        )
    async with node.client(tenants.keys["narrow"]) as n:  # may use pool gpu only; the model is on cpu
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await answer(n, prompt="p", max_tokens=2, metadata={"tier": "premium"})
        assert code_of(exc) == grpc.StatusCode.PERMISSION_DENIED and "pool 'cpu'" in (exc.value.details() or "")


# --- bounded requests


async def test_a_caller_without_a_key_has_nothing_of_its_request_parsed(secured: tuple[SecuredNode, Tenants]) -> None:
    """UNAUTHENTICATED first, whatever the bytes: not a parse error, not the size limit (a setting)."""
    node, tenants = secured
    creds = grpc.ssl_channel_credentials(await asyncio.to_thread(Path(node.ca).read_bytes))
    for key in ("", "wrong"):
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        async with grpc.aio.secure_channel(node.address, creds) as channel:
            call = channel.unary_unary("/llamamesh.v1.BatchService/GetBatch")  # bytes as they are
            for data in (b"\xff\xff\xff", b"\x0a\x05" + b"x" * 5, bytes(5 << 20)):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call(data, metadata=metadata, timeout=30)
                assert code_of(exc) == grpc.StatusCode.UNAUTHENTICATED, (key, len(data), exc.value.details())
                assert "LLAMAMESH" not in (exc.value.details() or "")
    async with grpc.aio.secure_channel(node.address, creds) as channel:  # with a key: the bytes' own error
        call = channel.unary_unary("/llamamesh.v1.BatchService/GetBatch")
        metadata = (("authorization", f"Bearer {tenants.keys['alpha']}"),)
        for data, says in ((b"\xff\xff\xff", "does not parse"), (bytes(5 << 20), "MAX_REQUEST_BYTES")):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call(data, metadata=metadata, timeout=30)
            assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT and says in (exc.value.details() or "")


async def test_an_oversized_generate_is_refused_before_it_reaches_redis(
    secured: tuple[SecuredNode, Tenants], security_redis: RedisProcess
) -> None:
    node, tenants = secured
    r = redis.Redis(port=security_redis.port)
    before = set(r.scan_iter(f"{node.prefix}:*"))
    async with node.client(tenants.keys["alpha"]) as a:
        for size, code in ((5 << 20, grpc.StatusCode.INVALID_ARGUMENT), (65 << 20, None)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await answer(a, request_id=f"big{size}", prompt="x" * size, max_tokens=2)
            # 5 MiB: past LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES, refused unparsed; 65 MiB: past what
            # the transport takes at all (RESOURCE_EXHAUSTED from gRPC) or the gatekeeper's bound.
            if code is not None:
                assert code_of(exc) == code and "LLAMAMESH_GATEWAY_MAX_REQUEST_BYTES" in (exc.value.details() or "")
            else:
                assert code_of(exc) in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        # a long prompt under the byte limit: bounded in characters before anything tokenises it
        text, _ = await answer(a, prompt="fine", max_tokens=2)
        assert text
    assert not [k for k in set(r.scan_iter(f"{node.prefix}:*")) - before if b"big" in k]
    assert all(p.poll() is None for p in node.procs.values())
    r.close()
