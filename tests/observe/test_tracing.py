"""OpenTelemetry traces end to end: real processes (redis-server, the gateway, a worker on the fake
engine) exporting over OTLP gRPC to a receiver started here; one Generate sent with a W3C
``traceparent`` comes back as one trace: the gateway's RPC span under the caller's span, the
worker's job span under the gateway's (across the Redis hop, in the job). A BatchGenerate's items
are spans of the worker under the BatchGenerate RPC's span."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from llamamesh.v1 import batch_pb2 as bpb
from llamamesh.v1 import batch_pb2_grpc, generation_pb2_grpc
from llamamesh.v1 import generation_pb2 as pb
from tests.e2e.conftest import ProcessNode, e2e_redis
from tests.redisproc import RedisProcess, free_port
from tests.waiting import wait_until
from workers.job import PROBE_PREFIX

__all__ = ["e2e_redis"]  # the session's Redis fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(otlp_grpc.TraceServiceServicer):
    """An OTLP trace receiver: every exported span, with its process's ``service.name``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Span]] = []
        self._lock = threading.Lock()

    def Export(
        self, request: otlp.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> otlp.ExportTraceServiceResponse:
        with self._lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                self.spans.extend((service, s) for ss in rs.scope_spans for s in ss.spans)
        return otlp.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[tuple[str, Span]]:
        with self._lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    rec, port = Receiver(), free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    otlp_grpc.add_TraceServiceServicer_to_server(rec, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield rec, port
    server.stop(None)


@pytest.fixture
def traced(
    receiver: tuple[Receiver, int], e2e_redis: RedisProcess, tmp_path: Path
) -> Iterator[tuple[Receiver, ProcessNode]]:
    """A node (gateway + fake-engine worker) exporting its spans to the receiver."""
    rec, port = receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    node = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env=env)
    try:
        node.start(timeout_s=60)
        yield rec, node
    finally:
        node.stop()


def wait_for_spans(rec: Receiver, trace_id: str, want: dict[tuple[str, str], int]) -> list[tuple[str, Span]]:
    """The trace's spans once ``want[(service, name)]`` of each arrived (bounded poll: both processes
    export within their schedule delay)."""

    def arrived(spans: list[tuple[str, Span]]) -> bool:
        seen = [(svc, s.name) for svc, s in spans]
        return all(seen.count(w) >= n for w, n in want.items())

    try:
        return wait_until(lambda: rec.of_trace(trace_id), 30, f"spans {want}", done=arrived, poll_s=0.1)
    except TimeoutError:
        return rec.of_trace(trace_id)  # the callers' assertions say what is missing


def parents(spans: list[tuple[str, Span]], span: Span) -> Span:
    """The farthest ancestor of ``span`` among ``spans``."""
    by_id = {s.span_id: s for _, s in spans}
    at = span
    while at.parent_span_id in by_id:
        at = by_id[at.parent_span_id]
    return at


def test_one_trace_from_the_caller_through_the_gateway_and_redis_to_the_worker(
    traced: tuple[Receiver, ProcessNode],
) -> None:
    rec, node = traced
    with grpc.insecure_channel(node.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        req = pb.GenerateRequest(prompt="count", max_tokens=5, ignore_eos=True)
        meta = (("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01"),)
        tokens = sum(len(m.token_ids) for m in stub.Generate(req, metadata=meta, timeout=30))
    assert tokens == 5
    spans = wait_for_spans(rec, TRACE_ID, {("gateway", "Generate"): 1, ("worker", "job"): 1})
    names = sorted((svc, s.name) for svc, s in spans)
    rpc = next((s for svc, s in spans if (svc, s.name) == ("gateway", "Generate")), None)
    job = next((s for svc, s in spans if (svc, s.name) == ("worker", "job")), None)
    assert rpc is not None and job is not None, names
    assert rpc.parent_span_id.hex() == CALLER_SPAN, names
    assert rpc.kind == Span.SPAN_KIND_SERVER
    assert {e.name for e in rpc.events} >= {"job_submitted", "first_token"}
    assert parents(spans, job) is rpc, names  # the job's parents lead up to the gateway's RPC span
    assert ("worker", "queue_wait") in names and ("worker", "prefill") in names, names
    # the job's log lines carry the trace id
    assert f'"trace_id": "{TRACE_ID}"' in node.log("worker") or f'"trace_id":"{TRACE_ID}"' in node.log("worker")
    assert TRACE_ID in node.log("gateway")
    # The gateways' health probes run jobs on the worker too (the node was SERVING only after one
    # answered): none of them leaves a span.
    with rec._lock:
        ids = [a.value.string_value for _, s in rec.spans for a in s.attributes if a.key == "llamamesh.request_id"]
    assert ids and not [i for i in ids if i.startswith(PROBE_PREFIX)], ids


BATCH_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def test_batch_items_are_spans_under_the_batch_generate_span(traced: tuple[Receiver, ProcessNode]) -> None:
    rec, node = traced
    one = pb.GenerateRequest(prompt="sum", max_tokens=3, ignore_eos=True)
    items = [bpb.BatchItem(custom_id=f"doc-{i}", request=one) for i in range(3)]
    with grpc.insecure_channel(node.address) as channel:
        stub = batch_pb2_grpc.BatchServiceStub(channel)
        meta = (("traceparent", f"00-{BATCH_TRACE_ID}-{CALLER_SPAN}-01"),)
        stub.BatchGenerate(bpb.BatchGenerateRequest(batch_id="traced", items=items), metadata=meta, timeout=30)
    spans = wait_for_spans(rec, BATCH_TRACE_ID, {("gateway", "BatchGenerate"): 1, ("worker", "job"): 3})
    names = sorted((svc, s.name) for svc, s in spans)
    rpc = next((s for svc, s in spans if (svc, s.name) == ("gateway", "BatchGenerate")), None)
    jobs = [s for svc, s in spans if (svc, s.name) == ("worker", "job")]
    assert rpc is not None and len(jobs) == 3, names
    assert rpc.parent_span_id.hex() == CALLER_SPAN
    for job in jobs:
        assert job.parent_span_id == rpc.span_id, names
        attrs = {a.key: a.value.string_value for a in job.attributes}
        assert attrs["llamamesh.kind"] == "batch_item" and attrs["llamamesh.status"] == "ok", attrs
