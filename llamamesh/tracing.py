"""OpenTelemetry tracing: the SDK configured once per process (``configure``), and the trace context
that crosses the Redis hop in the job (``GenerationRequest.trace``, W3C ``traceparent`` /
``tracestate``: ``carrier`` on the way in, ``extract`` on the way out). Only this module imports
opentelemetry; the gateway and the workers go through its functions (no engine adapter does).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llamamesh.settings import otel_service_named, otlp_endpoint

_PROPAGATOR = TraceContextTextMapPropagator()
_configured = False


def resource_attributes(service: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The resource attributes this process adds to what the SDK reads from the environment:
    ``service.name`` = ``service``, unless OpenTelemetry's own variables name the service (the
    attributes given here would override them)."""
    return {} if otel_service_named(environ) else {"service.name": service}


def configure(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Install the SDK (a BatchSpanProcessor exporting over OTLP gRPC, ``service.name`` =
    ``service`` unless the environment names it: :func:`resource_attributes`, and the other
    ``OTEL_RESOURCE_ATTRIBUTES``) when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT``); once per process,
    from the entry points. True when tracing is on. Off, the API's no-op tracer is used and no SDK
    object is created: spans are non-recording, but a caller's trace id still flows to the worker
    and into the logs."""
    global _configured
    if _configured:
        return True
    if not otlp_endpoint(environ):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create(resource_attributes(service, environ)))  # flushed at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads the OTEL_* variables
    trace.set_tracer_provider(provider)
    _configured = True
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer("llamamesh")


def extract(carrier: Mapping[str, str]) -> Context:
    """The context whose parent is the span named by ``carrier``'s ``traceparent`` (none: a root)."""
    return _PROPAGATOR.extract(carrier)


def carrier(context: Context | None = None) -> Mapping[str, str]:
    """The current span (or ``context``'s) as W3C headers, for the job; empty when there is none."""
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out, context)
    return MappingProxyType(out)


def bind_trace_id(span: trace.Span) -> None:
    """Bind the span's ``trace_id`` to this task's log lines (structlog contextvars), if it has one."""
    ctx = span.get_span_context()
    if ctx.is_valid:
        structlog.contextvars.bind_contextvars(trace_id=trace.format_trace_id(ctx.trace_id))


def event(name: str, **attributes: str | int | float | bool) -> None:
    """An event on the current span (nothing when it does not record)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes)


@contextlib.contextmanager
def server_span(
    method: str, metadata: Iterable[tuple[str, str | bytes]] | None, system: str = "grpc"
) -> Iterator[trace.Span]:
    """The current span of one RPC (``system``: grpc, or http for the HTTP door), continuing the
    caller's ``traceparent`` metadata (else a new trace); its ``trace_id`` is bound to the call's
    log lines. Set its outcome with ``ended``."""
    headers = {k.lower(): v for k, v in metadata or () if isinstance(v, str)}
    attributes = {"rpc.system": system, "rpc.method": method}
    with tracer().start_as_current_span(
        method,
        context=extract(headers),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        bind_trace_id(span)
        try:
            yield span
        finally:
            structlog.contextvars.unbind_contextvars("trace_id")


def ended(span: trace.Span, outcome: str) -> None:
    """Record how the span's work ended: ``ok``, or a failure's name (a gRPC code, a domain code)."""
    if not span.is_recording():
        return
    span.set_attribute("llamamesh.status", outcome)
    if outcome == "CANCELLED" or outcome == "cancelled":
        span.add_event("cancelled")
    elif outcome != "ok":
        span.set_status(Status(StatusCode.ERROR, outcome))


class JobSpan:
    """A worker's span of one job, continuing the gateway's (``carrier``: the job's ``trace``) and
    current from ``start`` to ``end``; before it, a ``queue_wait`` span from the gateway's
    acceptance to the start. Its ``trace_id`` is bound to the job's log lines meanwhile.
    ``traced=False`` (the gateways' health probes): no span at all, so that probes, which run every
    few seconds on every worker, do not crowd the traces of real work."""

    def __init__(
        self,
        carrier: Mapping[str, str],
        accepted_ns: int,
        started_ns: int,
        attributes: Mapping[str, str] = MappingProxyType({}),
        traced: bool = True,
    ) -> None:
        parent = extract(carrier)
        t = tracer()
        self.started_ns = started_ns
        if not traced:
            self.span: trace.Span = trace.INVALID_SPAN
        else:
            if 0 < accepted_ns < started_ns:
                t.start_span("queue_wait", context=parent, start_time=accepted_ns).end(end_time=started_ns)
            self.span = t.start_span(
                "job", context=parent, kind=trace.SpanKind.CONSUMER, start_time=started_ns, attributes=attributes
            )
        self._token = otel_context.attach(trace.set_span_in_context(self.span, parent))
        bind_trace_id(self.span)

    def end(self, outcome: str, first_token_ns: int = 0) -> None:
        """End it (``outcome`` as for ``ended``); with a first token, its ``prefill`` (start to first
        token) and ``decode`` (first token to now) spans."""
        now = time.time_ns()
        if self.span.is_recording() and first_token_ns:
            self.span.add_event("first_token", timestamp=first_token_ns)
            inside = trace.set_span_in_context(self.span)
            tracer().start_span("prefill", context=inside, start_time=self.started_ns).end(end_time=first_token_ns)
            tracer().start_span("decode", context=inside, start_time=first_token_ns).end(end_time=now)
        ended(self.span, outcome)
        self.span.end(end_time=now)
        otel_context.detach(self._token)
        structlog.contextvars.unbind_contextvars("trace_id")
