"""Scraper mode: latency samples from a Triton server's ``/metrics``, for setups where
the gateway cannot be changed to report.

Triton exposes cumulative counters per model and version: successes and failures,
request duration in microseconds, and (decoupled models, or with
``--metrics-config histogram_latencies=true``) the first-response histogram in
milliseconds. Every ``interval_s`` the scraper reads them, takes the difference from
the last read, and turns it into samples for the model's class (the loop, the
baseline and the server's gauges: ``qosd_client.scraping``):

- one sample per request that finished in the interval (scaled down to
  ``max_samples`` when more did, keeping the proportions), all with the interval's
  mean end-to-end latency (Triton only gives sums);
- TTFTs spread over the histogram's buckets in proportion to their counts, and within
  a bucket between its bounds (``qosd_client.histograms``); requests above the last
  finite bound count as twice that bound; first responses of requests not yet done
  wait for the reads where requests succeed (``FirstTokensWaiting``);
- failures (``nv_inference_request_failure``) as ERROR samples, or CANCELLED for
  reason ``CANCELED``;
- a request's e2e is never below its TTFT.

No TPOT: Triton's metrics do not carry tokens. A counter that went down means the
server restarted, and its new values are the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from qosd_client.histograms import FirstTokensWaiting, bucket_deltas, spread
from qosd_client.scraping import MetricsScraper
from qosd_client.types import LatencySample, Outcome

SUCCESS = "nv_inference_request_success"
FAILURE = "nv_inference_request_failure"
DURATION = "nv_inference_request_duration_us"
FIRST_RESPONSE = "nv_inference_first_response_histogram_ms"


@dataclass
class ModelCounters:
    """One model's counters at one read, summed over its versions."""

    success: float = 0.0
    failure: float = 0.0  # every reason but CANCELED
    cancelled: float = 0.0  # reason CANCELED: the caller went away
    duration_us: float = 0.0
    # Cumulative bucket counts by upper bound (math.inf for +Inf).
    first_response: dict[float, float] = field(default_factory=dict)


def parse_triton_metrics(text: str) -> dict[str, ModelCounters]:
    """Triton's exposition text, per model. Other metrics are ignored.

    Samples are matched by name, not by the family a ``# TYPE`` line declares, so the
    form Triton's documentation shows (bucket lines named like the histogram, without
    ``_bucket``) reads the same as what the server writes."""
    models: dict[str, ModelCounters] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            counters = models.setdefault(model, ModelCounters())
            name = sample.name.removesuffix("_total")
            if name == SUCCESS:
                counters.success += sample.value
            elif name == FAILURE and sample.labels.get("reason") == "CANCELED":
                counters.cancelled += sample.value
            elif name == FAILURE:
                counters.failure += sample.value
            elif name == DURATION:
                counters.duration_us += sample.value
            elif name in (f"{FIRST_RESPONSE}_bucket", FIRST_RESPONSE) and "le" in sample.labels:
                bound = float(sample.labels["le"])
                counters.first_response[bound] = (
                    counters.first_response.get(bound, 0.0) + sample.value
                )
    return models


def _delta(after: float, before: float, reset: bool) -> float:
    return after if reset else max(0.0, after - before)


def samples_between(
    before: ModelCounters,
    after: ModelCounters,
    *,
    model: str,
    qos_class: str,
    max_samples: int = 200,
    first_tokens: FirstTokensWaiting | None = None,
) -> list[LatencySample]:
    """The samples one model's counters imply between two reads. ``first_tokens``: the
    model's first responses not yet given to a request that succeeded, kept across
    reads (without it, the TTFTs are the interval's own)."""
    reset = after.success < before.success or after.duration_us < before.duration_us
    new_first_tokens = bucket_deltas(before.first_response, after.first_response, reset=reset)
    if first_tokens is not None:
        if reset:
            first_tokens.clear()  # the requests in flight went down with the server
        first_tokens.add(new_first_tokens)
    succeeded = _delta(after.success, before.success, reset)
    failed = _delta(after.failure, before.failure, reset or after.failure < before.failure)
    cancelled = _delta(
        after.cancelled, before.cancelled, reset or after.cancelled < before.cancelled
    )
    if succeeded < 1 and failed < 1 and cancelled < 1:
        return []
    mean_e2e_ms = _delta(after.duration_us, before.duration_us, reset) / 1000 / max(succeeded, 1)
    scale = min(1.0, max_samples / (succeeded + failed + cancelled))
    ok_count = round(succeeded * scale)
    # Failed and cancelled requests take their share too (many had a first response):
    # the samples' TTFTs are the successes', spread over what all of them took.
    ttft_buckets = (
        new_first_tokens
        if first_tokens is None
        else first_tokens.take(succeeded + failed + cancelled)
    )
    ttfts: list[float | None] = [*spread(ttft_buckets, ok_count)]
    samples = [
        # A TTFT at its bucket's bound can exceed the interval's mean e2e; a request's
        # e2e is never below its TTFT.
        LatencySample(model, qos_class, ttft_ms=ttft, e2e_ms=max(mean_e2e_ms, ttft or 0.0))
        for ttft in (ttfts or [None] * ok_count)
    ]
    for count, status in ((failed, Outcome.ERROR), (cancelled, Outcome.CANCELLED)):
        scaled = max(1, round(count * scale)) if count >= 1 else 0
        samples.extend(
            LatencySample(model, qos_class, e2e_ms=mean_e2e_ms, status=status)
            for _ in range(scaled)
        )
    return samples


class TritonMetricsScraper(MetricsScraper[ModelCounters]):
    """Triton's ``/metrics`` (``qosd scrape --engine triton``)."""

    def __init__(self, *args: Any, **options: Any) -> None:
        """As ``MetricsScraper``."""
        super().__init__(*args, **options)
        self._first_tokens: dict[str, FirstTokensWaiting] = {}  # by model

    def parse(self, text: str) -> dict[str, ModelCounters]:
        return parse_triton_metrics(text)

    def empty(self) -> ModelCounters:
        return ModelCounters()

    def samples_between(
        self, before: ModelCounters, after: ModelCounters, *, model: str, qos_class: str
    ) -> list[LatencySample]:
        return samples_between(
            before, after, model=model, qos_class=qos_class, max_samples=self.max_samples,
            first_tokens=self._first_tokens.setdefault(model, FirstTokensWaiting()),
        )  # fmt: skip
