"""The proxy's spans and metrics in OpenTelemetry's GenAI semantic conventions, at the
version ``opentelemetry-semantic-conventions`` pins (its ``gen_ai_attributes`` and
``gen_ai_metrics``), so that a tracing backend shows them as it shows any LLM call.

One span per request the proxy parsed, named ``{gen_ai.operation.name}
{gen_ai.request.model}`` (``chat llama-3-8b``, ``text_completion llama-3-8b``), kind
CLIENT, in the caller's trace (``traceparent``), with the request's and the answer's
``gen_ai.*`` attributes, ``error.type`` when it failed, and qosd's own: the class,
the decision, the wait. Three server histograms, with the same operation, model and
error attributes plus ``qosd.class`` and ``qosd.decision``:
``gen_ai.server.request.duration`` of every request, and
``gen_ai.server.time_to_first_token`` and ``gen_ai.server.time_per_output_token`` of
the successful ones (as the conventions define them), in seconds. And, of each call
the proxy made upstream (it is that call's client), ``gen_ai.client.operation.duration``
and ``gen_ai.client.token.usage`` by ``gen_ai.token.type``. Each with the buckets the
conventions advise.

Where qosd departs from the conventions, and why (docs/observability.md): the span
covers admission as well as the upstream call (a request refused by qosd is a GenAI
request that failed, with ``error.type`` naming the reason, and its wait is part of
what the caller saw); the ``server`` metrics are measured at the proxy from the
request's arrival, so they include qosd's wait; ``gen_ai.provider.name`` is
``openai``, the API the proxy speaks to its upstreams, whoever serves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate
from opentelemetry.metrics import Meter, get_meter_provider
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer

#: The operation of each route, as the conventions name it.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
PROVIDER = "openai"
#: Bucket boundaries the conventions advise for each histogram (seconds; tokens).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                     20.48, 40.96, 81.92)  # fmt: skip
_TOKEN_COUNT_BUCKETS = tuple(4**n for n in range(14))  # 1, 4, 16, ... 67,108,864


@dataclass(frozen=True, slots=True)
class Finished:
    """How one request ended, as its span and metrics tell it."""

    path: str  # the route: its operation
    model: str
    qos_class: str
    decision: str  # admitted, rejected
    error_type: str | None  # None: it succeeded
    response_model: str | None
    usage: tuple[int, int] | None  # prompt and output tokens, as the upstream counted
    waited_ms: int  # in qosd's waiting room
    # (arrival, first token, last token, end) on one clock; first and last token of
    # a stream only (None: none streamed).
    times: tuple[float, float | None, float | None, float]
    output_tokens: int
    upstream: str | None  # the base URL it went to
    sent_at: float | None = None  # when the call upstream was sent (None: never)


class GenAiTelemetry:
    """What the proxy records of each request. ``tracer`` None: no spans (tracing off);
    ``meter`` None: the process's meter provider (a no-op one unless set)."""

    def __init__(self, tracer: Tracer | None, meter: Meter | None = None) -> None:
        self._tracer = tracer
        meter = meter or get_meter_provider().get_meter("qosd.proxy")
        self._ttft = meter.create_histogram(
            gen_ai_metrics.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, unit="s",
            description="Time to the first token, from the request's arrival at the proxy",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS,
        )  # fmt: skip
        self._tpot = meter.create_histogram(
            gen_ai_metrics.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN, unit="s",
            description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS,
        )  # fmt: skip
        self._client_duration = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION, unit="s",
            description="The call upstream, from its sending to its answer's end",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )  # fmt: skip
        self._client_tokens = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE, unit="{token}",
            description="Input and output tokens of the call upstream, as it counted them",
            explicit_bucket_boundaries_advisory=_TOKEN_COUNT_BUCKETS,
        )  # fmt: skip
        self._duration = meter.create_histogram(
            gen_ai_metrics.GEN_AI_SERVER_REQUEST_DURATION, unit="s",
            description="Time from the request's arrival at the proxy to its answer's end",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )  # fmt: skip

    def start(
        self,
        path: str,
        model: str,
        max_tokens: int | None,
        headers: Mapping[str, str],
        *,
        stream: bool = False,
        choices: int = 1,
    ) -> Span | None:
        """The request's span, in the caller's trace; None without a tracer. Its
        ``gen_ai.request.stream`` only when streamed, and its choice count only when
        not 1, as the conventions require them."""
        if self._tracer is None:
            return None
        operation = OPERATIONS[path]
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_OPERATION_NAME: operation,
            gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
            gen_ai.GEN_AI_REQUEST_MODEL: model,
        }
        if max_tokens is not None:
            attributes[gen_ai.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        if stream:
            attributes[gen_ai.GEN_AI_REQUEST_STREAM] = True
        if choices != 1:
            attributes[gen_ai.GEN_AI_REQUEST_CHOICE_COUNT] = choices
        parent = propagate.extract(headers)
        return self._tracer.start_span(
            f"{operation} {model}", context=parent, kind=SpanKind.CLIENT, attributes=attributes
        )

    def finish(self, span: Span | None, done: Finished) -> None:
        """Ends ``span`` and records the metrics of a request that ended as ``done``."""
        path, model = done.path, done.model
        error_type, times = done.error_type, done.times
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_OPERATION_NAME: OPERATIONS[path],
            gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
            gen_ai.GEN_AI_REQUEST_MODEL: model,
            "qosd.class": done.qos_class,
            "qosd.decision": done.decision,
        }
        if done.response_model:
            attributes[gen_ai.GEN_AI_RESPONSE_MODEL] = done.response_model
        if error_type:
            attributes[error_attributes.ERROR_TYPE] = error_type
        arrived, first, last, ended = times
        self._duration.record(ended - arrived, attributes)
        if error_type is None and first is not None:  # of successful responses only
            self._ttft.record(first - arrived, attributes)
            if last is not None and done.output_tokens > 1:
                self._tpot.record((last - first) / (done.output_tokens - 1), attributes)
        server: dict[str, Any] = {}
        if done.upstream is not None:
            where = urlsplit(done.upstream)
            server[server_attributes.SERVER_ADDRESS] = where.hostname or ""
            if where.port is not None:
                server[server_attributes.SERVER_PORT] = where.port
        if done.sent_at is not None:
            self._record_client(done, {**attributes, **server}, ended - done.sent_at)
        if span is None:
            return
        span.set_attributes({**attributes, **server, "qosd.wait_ms": done.waited_ms})
        if done.usage is not None:
            span.set_attributes(
                {gen_ai.GEN_AI_USAGE_INPUT_TOKENS: done.usage[0],
                 gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: done.usage[1]}
            )  # fmt: skip
        if error_type:
            span.set_status(StatusCode.ERROR, error_type)
        span.end()

    def _record_client(self, done: Finished, attributes: dict[str, Any], took_s: float) -> None:
        """The call upstream, as its client measures it: its duration, and the tokens
        it counted (when the upstream said)."""
        self._client_duration.record(took_s, attributes)
        if done.usage is not None:
            tokens = gen_ai.GenAiTokenTypeValues
            for kind, count in ((tokens.INPUT, done.usage[0]), (tokens.COMPLETION, done.usage[1])):
                self._client_tokens.record(
                    count, {**attributes, gen_ai.GEN_AI_TOKEN_TYPE: kind.value}
                )
