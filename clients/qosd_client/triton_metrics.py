"""Scraper mode: latency samples from a Triton server's ``/metrics``, for setups where
the gateway cannot be changed to report.

Triton exposes cumulative counters per model and version: successes and failures,
request duration in microseconds, and (decoupled models, or with
``--metrics-config histogram_latencies=true``) the first-response histogram in
milliseconds. Every ``interval_s`` the scraper reads them, takes the difference from
the last read, and turns it into samples for the model's class:

- one sample per request that finished in the interval (scaled down to
  ``max_samples`` when more did, keeping the proportions), all with the interval's
  mean end-to-end latency (Triton only gives sums);
- TTFTs spread over the histogram's buckets in proportion to their counts, each at
  its bucket's upper bound (pessimistic: a request in the 100–500 ms bucket counts as
  500 ms); requests above the last finite bound count as twice that bound;
- failures (``nv_inference_request_failure``) as ERROR samples, or CANCELLED for
  reason ``CANCELED``;
- a request's e2e is never below its TTFT.

No TPOT: Triton's metrics do not carry tokens. A counter that went down means the
server restarted, and its new values are the difference. The first read only sets
the baseline. Samples go to a reporter (``LatencyReporter``) like any others.

With ``on_loads``, every read also hands over the server's own gauges (its pending
requests, and vLLM's waiting requests and KV cache usage: ``qosd_client.server_load``),
the first read included, for ``QosdClient.report(loads=...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from qosd_client.server_load import server_loads
from qosd_client.types import LatencySample, Outcome, SampleSink, ServerLoad

log = logging.getLogger("qosd_client.triton_metrics")

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
) -> list[LatencySample]:
    """The samples one model's counters imply between two reads."""
    reset = after.success < before.success or after.duration_us < before.duration_us
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
    ttfts: list[float | None] = [*_spread(_bucket_deltas(before, after, reset), ok_count)]
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


def _bucket_deltas(
    before: ModelCounters, after: ModelCounters, reset: bool
) -> list[tuple[float, float]]:
    """(TTFT to count as, requests) per histogram bucket, in the interval."""
    bounds = sorted(after.first_response)
    finite = [bound for bound in bounds if math.isfinite(bound)]
    deltas: list[tuple[float, float]] = []
    previous = 0.0
    for bound in bounds:
        cumulative = _delta(after.first_response[bound], before.first_response.get(bound, 0.0),
                            reset)  # fmt: skip
        count = cumulative - previous
        previous = cumulative
        if count > 0:
            value = bound if math.isfinite(bound) else 2 * (finite[-1] if finite else 1000.0)
            deltas.append((value, count))
    return deltas


def _spread(buckets: list[tuple[float, float]], count: int) -> list[float]:
    """``count`` values distributed over the buckets in proportion to their counts."""
    total = sum(n for _, n in buckets)
    if not buckets or total <= 0 or count <= 0:
        return []
    values: list[float] = []
    cumulative = 0.0
    index = 0
    for i in range(count):
        quantile = (i + 0.5) / count * total
        while index < len(buckets) - 1 and cumulative + buckets[index][1] < quantile:
            cumulative += buckets[index][1]
            index += 1
        values.append(buckets[index][0])
    return values


@dataclass(slots=True)
class ScraperStats:
    reads: int = 0
    failed_reads: int = 0
    samples: int = 0
    unmapped_models: int = 0  # models with no class (and no default class)
    loads: int = 0  # server loads handed to on_loads
    failed_loads: int = 0  # on_loads calls that raised


class TritonMetricsScraper:
    """Reads ``url`` every ``interval_s`` and records samples into ``sink``.

    ``classes`` maps model names to QoS classes; models it does not name use
    ``default_class``, or are skipped when that is None.
    """

    def __init__(
        self,
        url: str,
        sink: SampleSink,
        classes: Mapping[str, str],
        *,
        default_class: str | None = None,
        interval_s: float = 5.0,
        max_samples: int = 200,
        timeout_s: float = 2.0,
        server: str = "",
        on_loads: Callable[[list[ServerLoad]], Awaitable[object]] | None = None,
    ) -> None:
        """``on_loads`` receives the server's gauges at every read, named ``server``
        (by default the metrics URL)."""
        if interval_s <= 0 or max_samples < 1:
            raise ValueError("need interval_s > 0 and max_samples >= 1")
        self._url = url
        self._sink = sink
        self._classes = dict(classes)
        self._default_class = default_class
        self._interval_s = interval_s
        self._max_samples = max_samples
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._last: dict[str, ModelCounters] | None = None
        self._server = server or url
        self._on_loads = on_loads
        self.stats = ScraperStats()

    async def scrape_once(self, session: aiohttp.ClientSession) -> list[LatencySample]:
        """One read; returns (and records) the samples since the previous one."""
        try:
            async with session.get(self._url, timeout=self._timeout) as response:
                response.raise_for_status()
                text = await response.text()
            current = parse_triton_metrics(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            self.stats.failed_reads += 1
            log.warning("reading %s failed: %r", self._url, error)
            return []
        self.stats.reads += 1
        await self._hand_over_loads(text)
        baseline = self._last is None
        samples = self.samples_since_last(current)
        if baseline:
            log.info("baseline read from %s (%d models); reporting from the next read",
                     self._url, len(current))  # fmt: skip
        for sample in samples:
            self._sink.record(sample)
        self.stats.samples += len(samples)
        return samples

    async def _hand_over_loads(self, text: str) -> None:
        if self._on_loads is None:
            return
        loads = server_loads(text, self._server)
        if not loads:
            return
        try:
            await self._on_loads(loads)
        except Exception as error:
            self.stats.failed_loads += 1
            log.warning("reporting the load of %s failed: %r", self._server, error)
        else:
            self.stats.loads += len(loads)

    @property
    def has_baseline(self) -> bool:
        """Whether a read has succeeded: requests that finish from now on are reported."""
        return self._last is not None

    def samples_since_last(self, current: dict[str, ModelCounters]) -> list[LatencySample]:
        last, self._last = self._last, current
        if last is None:
            return []  # the first read is the baseline
        samples: list[LatencySample] = []
        for model, after in current.items():
            qos_class = self._classes.get(model, self._default_class)
            if qos_class is None:
                self.stats.unmapped_models += 1
                continue
            samples += samples_between(
                last.get(model, ModelCounters()), after,
                model=model, qos_class=qos_class, max_samples=self._max_samples,
            )  # fmt: skip
        return samples

    async def run(self, stop: asyncio.Event, on_baseline: Callable[[], None] | None = None) -> None:
        """Scrapes until ``stop`` is set; calls ``on_baseline`` once, after the first
        read that succeeds (the baseline)."""
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                await self.scrape_once(session)
                if on_baseline is not None and self.has_baseline:
                    on_baseline()
                    on_baseline = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._interval_s)
