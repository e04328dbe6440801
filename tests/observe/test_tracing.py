"""OpenTelemetry traces end to end: real processes (redis-server, the gateway, a worker on the fake
engine) exporting over OTLP gRPC to a receiver started here; one Generate sent with a W3C
``traceparent`` comes back as one trace: the gateway's RPC span under the caller's span, the
worker's job span under the gateway's (across the Redis hop, in the job)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from llamamesh.v1 import generation_pb2 as pb
from llamamesh.v1 import generation_pb2_grpc
from tests.e2e.conftest import ProcessNode, e2e_redis
from tests.redisproc import RedisProcess, free_port

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


def test_one_trace_from_the_caller_through_the_gateway_and_redis_to_the_worker(
    receiver: tuple[Receiver, int], e2e_redis: RedisProcess, tmp_path: Path
) -> None:
    rec, port = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    node = ProcessNode(tmp_path, e2e_redis, engine="fake", extra_env=env)
    try:
        node.start(timeout_s=60)
        with grpc.insecure_channel(node.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            req = pb.GenerateRequest(prompt="count", max_tokens=5, ignore_eos=True)
            meta = (("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01"),)
            tokens = sum(len(m.token_ids) for m in stub.Generate(req, metadata=meta, timeout=30))
        assert tokens == 5

        deadline = time.monotonic() + 30
        while True:  # bounded poll: both processes export within their schedule delay
            spans = rec.of_trace(TRACE_ID)
            services = {svc for svc, s in spans if (svc, s.name) in {("gateway", "Generate"), ("worker", "job")}}
            if services == {"gateway", "worker"} or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # polling the receiver, bounded by the deadline
        names = sorted((svc, s.name) for svc, s in spans)
        assert services == {"gateway", "worker"}, names
    finally:
        node.stop()

    by_id = {s.span_id: s for _, s in spans}
    rpc = next(s for svc, s in spans if (svc, s.name) == ("gateway", "Generate"))
    job = next(s for svc, s in spans if (svc, s.name) == ("worker", "job"))
    assert rpc.parent_span_id.hex() == CALLER_SPAN, names
    assert rpc.kind == Span.SPAN_KIND_SERVER
    assert {e.name for e in rpc.events} >= {"job_submitted", "first_token"}
    chain, at = [], job
    while at.parent_span_id in by_id:  # the job's parents, up to the gateway's RPC span
        at = by_id[at.parent_span_id]
        chain.append(at.name)
    assert at is rpc, (chain, names)
    assert ("worker", "queue_wait") in names and ("worker", "prefill") in names, names
    # the job's log lines carry the trace id
    assert f'"trace_id": "{TRACE_ID}"' in node.log("worker") or f'"trace_id":"{TRACE_ID}"' in node.log("worker")
    assert TRACE_ID in node.log("gateway")
