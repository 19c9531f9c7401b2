"""OpenTelemetry tracing: one span per RPC, continued from the caller's trace.

A gateway's trace should show where a request's time went, qosd included: the
admission decision, each store round trip, the time spent in the waiting room, and
later the latencies the model server reported for that request. So:

- ``traced_handler`` makes the server span of each qosd RPC, continuing the W3C
  context taken from gRPC metadata (health and reflection are not traced: probes
  would bury the requests);
- the servicer adds what qosd decided as ``qosd.*`` attributes (``annotate_*``);
- ``qosd.store.instrumented`` adds a child span per store call, ``Admission`` one for
  the waiting room;
- a ``Report`` sample that carries a ``traceparent`` gets a span in that request's
  trace (``sample_spans``), linked to the Report call that delivered it.

Tracing that is off wraps no handler and creates no spans: the hot path pays one
``is None`` test per call (measured in ``docs/observability.md``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import (
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    SERVICE_VERSION,
    OTELResourceDetector,
    Resource,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from qosd.config import TracingConfig, TracingExporter
from qosd.model import Reason

if TYPE_CHECKING:
    from qosd.admission import AcquireOutcome
    from qosd.model import Sample, Settlement
    from qosd_client.v1 import qosd_pb2

log = logging.getLogger(__name__)

TRACER_NAME = "qosd"
SHUTDOWN_TIMEOUT_S = 2.0  # a collector that is down must not hold up a drain
_W3C = TraceContextTextMapPropagator()
_TRUE = ("true", "1", "yes", "on")


def tracing_enabled(config: TracingConfig, env: Mapping[str, str] | None = None) -> bool:
    """The config's ``enabled``, or else whether the environment asks for traces."""
    environment = os.environ if env is None else env
    if environment.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        if config.enabled:
            # The SDK would hand out no-op tracers: say so rather than trace nothing.
            log.warning("tracing.enabled is true but OTEL_SDK_DISABLED is set: tracing off")
        return False
    if config.enabled is not None:
        return config.enabled
    if environment.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(
        environment.get(name)
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


@dataclass
class Tracing:
    """The daemon's tracer provider; one per daemon, never the process's global one,
    so that several daemons (tests, benchmarks) can run in one process."""

    provider: TracerProvider
    tracer: Tracer
    # Set when sampling follows tracing.sample_ratio, so that a reload can change it.
    sampler: AdjustableRatioSampler | None = None
    # Metrics in OpenTelemetry's own model (the proxy's GenAI histograms), exported
    # beside the spans; /metrics holds the rest.
    meter_provider: MeterProvider | None = None

    async def shutdown(self) -> None:
        """Exports what is buffered, within ``SHUTDOWN_TIMEOUT_S``.

        On a daemon thread that nothing waits for past the timeout: with the collector
        down, the SDK's flush can block for its whole export timeout (10 s) per batch,
        and an executor thread would hold the process's exit for as long."""
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def flush_and_stop() -> None:
            try:
                self.provider.shutdown()  # flushes the batch processor first
                if self.meter_provider is not None:
                    self.meter_provider.shutdown()
            finally:
                loop.call_soon_threadsafe(done.set)

        threading.Thread(target=flush_and_stop, name="qosd-tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done.wait(), SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            log.warning("tracing: spans not exported within %.1fs, dropped", SHUTDOWN_TIMEOUT_S)


def start_tracing(
    config: TracingConfig, daemon_id: str, env: Mapping[str, str] | None = None
) -> Tracing | None:
    """A tracer provider exporting as configured, or None when tracing is off."""
    if not tracing_enabled(config, env):
        return None
    sampler = None  # the SDK reads OTEL_TRACES_SAMPLER(_ARG) itself
    if config.sample_ratio is not None:
        sampler = AdjustableRatioSampler(config.sample_ratio)
    provider = TracerProvider(resource=_resource(config, daemon_id), sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
    log.info(
        "tracing on: %s exporter to %s",
        config.exporter.value,
        config.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the default endpoint",
    )  # fmt: skip
    meters = MeterProvider(
        resource=provider.resource,
        metric_readers=[PeriodicExportingMetricReader(_metric_exporter(config))],
    )
    return Tracing(provider, provider.get_tracer(TRACER_NAME, _version()), sampler, meters)


class AdjustableRatioSampler(Sampler):
    """Parent-based sampling at a ratio that a config reload can change.

    The SDK fixes a provider's sampler when it is made; this one keeps the delegate it
    asks, and swaps it whole (one reference, so a span sees one ratio or the other)."""

    def __init__(self, ratio: float) -> None:
        self._delegate = ParentBased(TraceIdRatioBased(ratio))
        self.ratio = ratio

    def set_ratio(self, ratio: float) -> None:
        self._delegate = ParentBased(TraceIdRatioBased(ratio))
        self.ratio = ratio

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        return self._delegate.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"AdjustableRatioSampler({self.ratio})"


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.exporter is TracingExporter.CONSOLE:
        return ConsoleSpanExporter()
    # None leaves each setting to its OTEL_EXPORTER_OTLP_* variable.
    return OTLPSpanExporter(endpoint=config.endpoint, headers=config.headers or None)


def _metric_exporter(config: TracingConfig) -> MetricExporter:
    if config.exporter is TracingExporter.CONSOLE:
        return ConsoleMetricExporter()
    return OTLPMetricExporter(endpoint=config.endpoint, headers=config.headers or None)


def _resource(config: TracingConfig, daemon_id: str) -> Resource:
    """Configured attributes, then OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME, then
    qosd's defaults. The instance id defaults to the daemon id, which is also what
    ``Admin/GetStatus`` and the leader lease name the daemon by."""
    attributes: dict[str, Any] = dict(config.resource_attributes)
    if config.service_name:
        attributes[SERVICE_NAME] = config.service_name
    from_environment = OTELResourceDetector().detect().attributes
    for key, default in ((SERVICE_INSTANCE_ID, daemon_id), (SERVICE_VERSION, _version())):
        if key not in attributes and key not in from_environment:
            attributes[key] = default
    # Resource.create reads the environment; what is passed in wins over it.
    resource = Resource.create(attributes)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "qosd"}))
    return resource


def _version() -> str:
    try:
        return version("qosd")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0"


# -- the server span of each RPC --------------------------------------------------

Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]

# Codes that are the server's failure, not the caller's (OpenTelemetry's RPC
# conventions): only these set the span's status to ERROR.
_SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def traced_handler(tracer: Tracer, service: str, method: str, handler: Handler) -> Handler:
    """``handler`` inside a SERVER span continuing the caller's trace.

    Written against the OpenTelemetry API rather than taken from
    opentelemetry-instrumentation-grpc: its aio interceptor cost 36 % of Acquire
    throughput even with no trace sampled (docs/observability.md), and qosd wraps its
    own handlers already, so the span is a few calls here.
    """
    name = f"{service}/{method}"
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    start_span = tracer.start_as_current_span
    extract = propagate.extract

    async def run(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        metadata = context.invocation_metadata() or ()
        parent = extract({key: value for key, value in metadata})
        with start_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                response = await handler(raw, context)
            except grpc.aio.AbortError:
                if span.is_recording():
                    _set_code(span, context.code(), context.details())
                raise
            except asyncio.CancelledError:  # the caller went away (other errors are
                # aborts already: the decoding wrapper turns them into INTERNAL)
                if span.is_recording():
                    _set_code(span, grpc.StatusCode.CANCELLED, "")
                raise
            if span.is_recording():
                span.set_attribute("rpc.grpc.status_code", 0)
            return response

    return run


def _set_code(span: Span, code: grpc.StatusCode | None, details: str | bytes | None) -> None:
    code = code or grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_FAULTS:
        text = details.decode() if isinstance(details, bytes) else details or ""
        span.set_status(StatusCode.ERROR, f"{code.name}: {text}")


# -- what the servicer adds to its RPC's span ---------------------------------------


def recording_span() -> Span | None:
    """The current span if it records: an unsampled call skips building attributes."""
    span = trace.get_current_span()
    return span if span.is_recording() else None


def annotate_acquire_request(span: Span, request: qosd_pb2.AcquireRequest) -> None:
    """Set before deciding, so that a refused (invalid) request still says what it was."""
    span.set_attributes(
        {
            "qosd.class": request.qos_class,
            "qosd.tenant": request.tenant,
            "qosd.model": request.model,
            "qosd.request_id": request.request_id,
            "qosd.input_tokens": request.input_tokens,
            "qosd.expected_output_tokens": request.expected_output_tokens,
        }
    )


def annotate_acquire(span: Span, outcome: AcquireOutcome) -> None:
    decision = outcome.decision
    span.set_attributes(
        {
            "qosd.pool": outcome.pool,
            "qosd.decision": "admitted" if decision.admitted else "rejected",
            "qosd.reason": Reason(decision.reason).name,
            "qosd.cost_tokens": decision.charged,
            "qosd.wait_ms": outcome.waited_ms,
            "qosd.lease_id": decision.lease_id,
            "qosd.retry_after_ms": decision.retry_after_ms,
            "qosd.remaining_tokens": decision.remaining,
        }
    )


def annotate_release_request(span: Span, request: qosd_pb2.ReleaseRequest) -> None:
    pool, _, rest = request.lease_id.partition(":")
    attributes: dict[str, Any] = {
        "qosd.lease_id": request.lease_id,
        "qosd.pool": pool,
        "qosd.class": rest.partition(":")[0],
        "qosd.outcome": request.outcome,
    }
    if request.HasField("actual_input_tokens"):
        attributes["qosd.actual_input_tokens"] = request.actual_input_tokens
    if request.HasField("actual_output_tokens"):
        attributes["qosd.actual_output_tokens"] = request.actual_output_tokens
    span.set_attributes(attributes)


def annotate_release(span: Span, settlement: Settlement) -> None:
    span.set_attributes(
        {
            "qosd.cost_tokens": settlement.charged,
            "qosd.adjustment_tokens": settlement.adjustment,
            "qosd.remaining_tokens": settlement.remaining,
            "qosd.already_released": settlement.already_released,
        }
    )


def sample_spans(
    tracer: Tracer,
    report_span: Span,
    delivered: Iterable[tuple[qosd_pb2.LatencySample, Sample]],
) -> None:
    """A span in each reported request's own trace, so the gateway's trace ends with
    the latencies the model server measured; linked to the Report call that carried
    it, which batches samples from many traces. A missing or malformed
    ``traceparent`` gets no span (W3C: a receiver ignores a header it cannot parse)."""
    link = [Link(report_span.get_span_context())] if report_span.is_recording() else None
    for item, sample in delivered:
        if not item.traceparent:
            continue
        parent = _W3C.extract({"traceparent": item.traceparent})
        if not trace.get_current_span(parent).get_span_context().is_valid:
            continue
        attributes: dict[str, Any] = {
            "qosd.pool": sample.pool,
            "qosd.class": sample.qos_class,
            "qosd.model": item.model,
            "qosd.tenant": sample.tenant,
            "qosd.status": sample.status.name,
            "qosd.input_tokens": sample.input_tokens,
            "qosd.output_tokens": sample.output_tokens,
        }
        for name, value in (
            ("qosd.ttft_ms", sample.ttft_ms),
            ("qosd.tpot_ms", sample.tpot_ms),
            ("qosd.e2e_ms", sample.e2e_ms),
        ):
            if value is not None:
                attributes[name] = value
        if item.lease_id:
            attributes["qosd.lease_id"] = item.lease_id
        tracer.start_span(
            "qosd.report_sample",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            links=link,
        ).end()
