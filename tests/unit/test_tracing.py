"""llamamesh/tracing.py off (no OTLP endpoint): no SDK, yet a caller's trace context flows into the
job (and through the codec) and the worker's span continues it."""

from __future__ import annotations

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
