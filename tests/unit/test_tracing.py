"""llamamesh/tracing.py off (no OTLP endpoint): no SDK, yet a caller's trace context flows into the
job (and through the codec) and the worker's span continues it."""

from __future__ import annotations

import os
import subprocess
import sys

from llamamesh import tracing
from llamamesh.queue import codec
from llamamesh.types import GenerationRequest

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_off_without_an_endpoint_and_no_sdk_imported() -> None:
    code = (
        "import sys; from llamamesh import tracing; assert not tracing.configure('gateway', {}); "
        "assert 'opentelemetry.sdk' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_callers_context_crosses_the_job_and_continues_in_the_worker() -> None:
    with tracing.server_span("Generate", (("traceparent", PARENT),)):
        carried = tracing.carrier()
    assert carried["traceparent"].split("-")[1] == PARENT.split("-")[1]
    req = codec.decode_job(codec.encode_job(GenerationRequest("r1", "m", prompt="hi", trace=carried)))
    assert dict(req.trace) == dict(carried)
    job = tracing.JobSpan(req.trace, 1, 2)
    try:
        assert f"{job.span.get_span_context().trace_id:032x}" == PARENT.split("-")[1]
    finally:
        job.end("ok")
    assert dict(codec.decode_job(codec.encode_job(GenerationRequest("r2", "m", prompt="hi"))).trace) == {}


def run_python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


NAMED = (
    "from opentelemetry.sdk.resources import Resource; from llamamesh import tracing; "
    "r = Resource.create(tracing.resource_attributes('gateway')).attributes; "
    "print(r['service.name'], r.get('deployment.environment'))"
)


def test_the_service_is_named_by_otel_variables_when_they_name_it() -> None:
    assert tracing.resource_attributes("gateway", {}) == {"service.name": "gateway"}
    assert tracing.resource_attributes("gateway", {"OTEL_SERVICE_NAME": "llm-gw"}) == {}
    assert tracing.resource_attributes("gateway", {"OTEL_RESOURCE_ATTRIBUTES": "a=b, service.name=gw-eu"}) == {}
    assert tracing.resource_attributes("worker", {"OTEL_RESOURCE_ATTRIBUTES": "a=b"}) == {"service.name": "worker"}
    # Through the SDK itself, which reads the same variables.
    assert run_python(NAMED) == "gateway None"
    assert run_python(NAMED, OTEL_SERVICE_NAME="llm-gw", OTEL_RESOURCE_ATTRIBUTES="deployment.environment=prod") == (
        "llm-gw prod"
    )
    assert run_python(NAMED, OTEL_RESOURCE_ATTRIBUTES="service.name=gw-eu,deployment.environment=dev") == "gw-eu dev"


def test_an_untraced_job_leaves_no_span_a_traced_one_its_four() -> None:
    code = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "exported = InMemorySpanExporter()\n"
        "provider = TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(exported))\n"
        "trace.set_tracer_provider(provider)\n"
        "from llamamesh import tracing\n"
        "tracing.JobSpan({}, 1, 2, traced=False).end('ok', 3)\n"
        "assert not exported.get_finished_spans()\n"
        "tracing.JobSpan({}, 1, 2, {'llamamesh.request_id': 'r1'}).end('ok', 3)\n"
        "print(' '.join(sorted(s.name for s in exported.get_finished_spans())))\n"
    )
    assert run_python(code) == "decode job prefill queue_wait"
