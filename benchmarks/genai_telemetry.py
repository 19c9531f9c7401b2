"""What the proxy's GenAI spans and metrics cost a request, with tracing off and on.

    python -m benchmarks.genai_telemetry --json docs/results/genai_telemetry.json

``proxy_overhead`` measures the proxy as it ships, tracing off: the GenAI histograms
then record into OpenTelemetry's no-op meter and no span is made. With tracing on
(``tracing.enabled``), each request the proxy parsed gets a span with its ``gen_ai.*``
attributes and three histogram records. This times the proxy's own
``GenAiTelemetry.start`` and ``finish`` for one streamed chat completion, in this
process, both ways: off, and on with the SDK's tracer provider (a batch span
processor, as ``qosd.tracing`` sets up, exporting to memory) and meter provider (an
in-memory reader). Microseconds a request, the median of ``--rounds`` rounds of
``--requests`` each; what the exporter's thread does later, off the request's path,
is not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qosd.doors.proxy.telemetry import Finished, GenAiTelemetry
from qosd_harness import source_commit

PATH = "/v1/chat/completions"
HEADERS = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
# A streamed answer of 16 tokens: arrival, first token, last token, end (seconds).
DONE = Finished(
    path=PATH, model="llm", qos_class="P1", decision="admitted", error_type=None,
    response_model="llm", usage=(8, 16), waited_ms=0, times=(0.0, 0.01, 0.2, 0.21),
    output_tokens=16, upstream="http://127.0.0.1:8000",
)  # fmt: skip


def per_request_us(telemetry: GenAiTelemetry, requests: int) -> float:
    began = time.perf_counter()
    for _ in range(requests):
        span = telemetry.start(PATH, "llm", 16, HEADERS)
        telemetry.finish(span, DONE)
    return (time.perf_counter() - began) / requests * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000, help="a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    commit = source_commit(Path(__file__).resolve().parents[1])
    load_at_start = os.getloadavg()[0]
    spans = TracerProvider()
    spans.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
    ways = {
        "tracing_off": GenAiTelemetry(None),
        "tracing_on": GenAiTelemetry(spans.get_tracer("qosd"), meters.get_meter("qosd.proxy")),
    }
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    for telemetry in ways.values():  # warm
        per_request_us(telemetry, 2_000)
    for _ in range(args.rounds):  # alternated: the machine's moods fall on both
        for name, telemetry in ways.items():
            rounds[name].append(per_request_us(telemetry, args.requests))
    spans.shutdown()
    meters.shutdown()
    result: dict[str, Any] = {
        name: {"us_per_request_median": round(statistics.median(values), 1),
               "us_per_request": [round(v, 1) for v in values]}
        for name, values in rounds.items()
    }  # fmt: skip
    result["commit"] = commit
    result["load_average_at_start"] = load_at_start
    result["command"] = (
        f"python -m benchmarks.genai_telemetry --requests {args.requests} --rounds {args.rounds}"
    )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
