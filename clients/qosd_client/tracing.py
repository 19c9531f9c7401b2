"""W3C trace context for qosd calls, so that a gateway's trace continues through qosd.

The client puts the current OpenTelemetry context into each call's gRPC metadata with
the globally configured propagator (``OTEL_PROPAGATORS``; W3C ``traceparent`` by
default); qosd's spans then become children of the caller's. Without an active span
nothing is added, and a process that never set up OpenTelemetry pays one context
lookup per call.
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_W3C = TraceContextTextMapPropagator()

Metadata = tuple[tuple[str, str], ...]


def trace_metadata() -> Metadata | None:
    """gRPC metadata carrying the current trace context, or None outside a span."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


def current_traceparent() -> str:
    """The current span as a W3C ``traceparent`` value, or "" outside a span."""
    if not trace.get_current_span().get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent", "")
