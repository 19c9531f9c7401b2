"""Latency samples from the histograms of LLM engines' ``/metrics``: vLLM, SGLang and
TensorRT-LLM's ``trtllm-serve`` (``qosd scrape --engine NAME``; Triton, which keeps
sums and counters instead, is ``qosd_client.triton_metrics``).

Each engine keeps, per model, histograms of time to first token, time per output
token and end-to-end latency, in seconds. Between two reads the scraper
takes each histogram's bucket deltas (``qosd_client.histograms``) and makes one
sample per request that finished in the interval (the end-to-end histogram's count;
scaled down to ``max_samples``, keeping the proportions):

- its TTFT, TPOT and e2e are the values the deltas spread over the samples. TTFT and
  e2e are paired by rank (the sample with the i-th smallest TTFT has the i-th
  smallest e2e: e2e holds the TTFT), TPOT at random. Paired by rank too, TPOT made a
  class look more compliant than it was by 2.5 points on average and 6.6 at worst
  (within TTFT 500 ms and TPOT 50 ms), at random by 1.3 and 2.1: the misses of one
  request's TTFT and TPOT do not coincide as a rank pairing makes them
  (``benchmarks/histogram_samples.py``, ``docs/integrations.md``);
- its e2e is never below its TTFT;
- a TTFT is observed at a request's first token, and the request may finish in a
  later interval: the scraper keeps the first tokens of requests not yet finished
  (``FirstTokensWaiting``) and gives each interval's finished requests their share
  of them. Spread over the interval's observations alone, a class's TTFTs were lost
  whenever its first tokens and its finishes fell in different reads: always, for a
  class of one request at a time (a CI run once saw five requests reported with no
  TTFT).

Where an engine keeps TPOT per token (vLLM's ``inter_token_latency_seconds``) rather
than per request, the samples' TPOTs are spread over the tokens' distribution: the
same mean, weighted by tokens, and a wider spread. The engines' queue-time
histograms are not read: TTFT already holds the time queued, and the server's
waiting gauge (``qosd_client.server_load``) says how many wait. A histogram whose
count went down means the server restarted, and its new counts are the difference.
No errors: the engines' histograms count finished requests only.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from qosd_client.histograms import (
    Bucket,
    FirstTokensWaiting,
    bucket_deltas,
    counts_went_down,
    spread,
)
from qosd_client.scraping import MetricsScraper
from qosd_client.types import LatencySample, SampleSink


class Latency(Enum):
    TTFT = "ttft"
    TPOT = "tpot"
    E2E = "e2e"


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine's histograms by their names, in the order they are preferred (the
    first found of each latency is used), and the label that names the model."""

    name: str
    description: str
    histograms: dict[Latency, tuple[str, ...]]
    model_label: str = "model_name"
    to_ms: float = 1000.0  # the histograms' unit, in ms


PROFILES: dict[str, EngineProfile] = {
    profile.name: profile
    for profile in (
        EngineProfile(
            "vllm",
            "vLLM (V1 and older): vllm:time_to_first_token_seconds, "
            "vllm:request_time_per_output_token_seconds or vllm:inter_token_latency_seconds "
            "(vllm:time_per_output_token_seconds on older servers), "
            "vllm:e2e_request_latency_seconds",
            {
                Latency.TTFT: ("vllm:time_to_first_token_seconds",),
                Latency.TPOT: (
                    "vllm:request_time_per_output_token_seconds",
                    "vllm:inter_token_latency_seconds",
                    "vllm:time_per_output_token_seconds",
                ),
                Latency.E2E: ("vllm:e2e_request_latency_seconds",),
            },
        ),
        EngineProfile(
            "sglang",
            "SGLang: sglang:time_to_first_token_seconds, sglang:inter_token_latency_seconds "
            "(sglang:time_per_output_token_seconds on older servers), "
            "sglang:e2e_request_latency_seconds",
            {
                Latency.TTFT: ("sglang:time_to_first_token_seconds",),
                Latency.TPOT: (
                    "sglang:inter_token_latency_seconds",
                    "sglang:time_per_output_token_seconds",
                ),
                Latency.E2E: ("sglang:e2e_request_latency_seconds",),
            },
        ),
        EngineProfile(
            "trtllm",
            "TensorRT-LLM's trtllm-serve: trtllm_time_to_first_token_seconds, "
            "trtllm_time_per_output_token_seconds, trtllm_e2e_request_latency_seconds",
            {
                Latency.TTFT: ("trtllm_time_to_first_token_seconds",),
                Latency.TPOT: ("trtllm_time_per_output_token_seconds",),
                Latency.E2E: ("trtllm_e2e_request_latency_seconds",),
            },
        ),
    )
}


@dataclass
class HistogramCounts:
    """One histogram at one read: cumulative counts by upper bound, and its count."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0


@dataclass
class EngineCounters:
    """One model's histograms at one read."""

    histograms: dict[Latency, HistogramCounts] = field(default_factory=dict)


def parse_engine_metrics(text: str, profile: EngineProfile) -> dict[str, EngineCounters]:
    """An engine's exposition text, per model (summed over other labels, such as
    vLLM's ``engine``); of each latency, the first histogram of the profile's names
    that the text holds. Raises ValueError on text that does not parse."""
    wanted = {name for names in profile.histograms.values() for name in names}
    found: dict[str, dict[str, HistogramCounts]] = {}  # by histogram name, then model
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, _, suffix = sample.name.rpartition("_")
            model = sample.labels.get(profile.model_label)
            if name not in wanted or not model:
                continue
            histogram = found.setdefault(name, {}).setdefault(model, HistogramCounts())
            if suffix == "count":
                histogram.count += sample.value
            elif suffix == "bucket" and "le" in sample.labels:
                bound = float(sample.labels["le"])
                histogram.buckets[bound] = histogram.buckets.get(bound, 0.0) + sample.value
    models: dict[str, EngineCounters] = {}
    for latency, names in profile.histograms.items():
        chosen = next((name for name in names if name in found), "")
        for model, histogram in found.get(chosen, {}).items():
            models.setdefault(model, EngineCounters()).histograms[latency] = histogram
    return models


def _restarted(before: EngineCounters, after: EngineCounters) -> bool:
    """A histogram's count went down: the server restarted between the reads."""
    for latency, histogram in after.histograms.items():
        earlier = before.histograms.get(latency)
        if earlier and (histogram.count < earlier.count
                        or counts_went_down(earlier.buckets, histogram.buckets)):  # fmt: skip
            return True
    return False


def _at_least(value: float | None, floor: float | None) -> float | None:
    return value if value is None or floor is None else max(value, floor)


def _finished(counters: EngineCounters) -> float | None:
    """How many requests a read says have finished: the e2e histogram's count, or the
    first tokens' where the server writes no e2e (yet). The same rule on both reads
    of a difference: an engine writes a model's series on its first observation, so
    a read may show first tokens before any e2e, and counting the next read's whole
    e2e count after those reported the first requests twice."""
    for latency in (Latency.E2E, Latency.TTFT):
        if latency in counters.histograms:
            return counters.histograms[latency].count
    return None


def samples_between(
    before: EngineCounters,
    after: EngineCounters,
    *,
    model: str,
    qos_class: str,
    profile: EngineProfile,
    max_samples: int = 200,
    rng: random.Random | None = None,
    first_tokens: FirstTokensWaiting | None = None,
) -> list[LatencySample]:
    """The samples one model's histograms imply between two reads; ``rng`` pairs their
    TPOTs (a fixed seed by default). ``first_tokens``: the model's first tokens not yet
    given to a finished request, kept across reads (without it, the TTFTs are the
    interval's own)."""
    reset = _restarted(before, after)

    def deltas(latency: Latency) -> list[Bucket]:
        earlier = before.histograms.get(latency, HistogramCounts()).buckets
        return bucket_deltas(earlier, after.histograms[latency].buckets, reset=reset)

    new_first_tokens = deltas(Latency.TTFT) if Latency.TTFT in after.histograms else []
    if first_tokens is not None:
        if reset:
            first_tokens.clear()  # the requests in flight went down with the server
        first_tokens.add(new_first_tokens)
    done = _finished(after)
    if done is None:
        return []
    finished = done if reset else done - (_finished(before) or 0.0)
    if finished < 1:
        return []
    count = min(max_samples, round(finished))

    def values(latency: Latency) -> list[float | None]:
        if latency not in after.histograms:
            return [None] * count
        if latency is not Latency.TTFT:
            observed = deltas(latency)
        elif first_tokens is None:
            observed = new_first_tokens
        else:
            observed = first_tokens.take(finished)
        spread_ms = [value * profile.to_ms for value in spread(observed, count)]
        return [*spread_ms] if spread_ms else [None] * count

    ttft, tpot, e2e = values(Latency.TTFT), values(Latency.TPOT), values(Latency.E2E)
    (rng or random.Random(0)).shuffle(tpot)
    return [
        LatencySample(
            model, qos_class, ttft_ms=ttft[i], tpot_ms=tpot[i], e2e_ms=_at_least(e2e[i], ttft[i])
        )
        for i in range(count)
    ]


class EngineMetricsScraper(MetricsScraper[EngineCounters]):
    """An engine's ``/metrics`` by its profile (``qosd scrape --engine vllm``)."""

    def __init__(
        self,
        profile: EngineProfile,
        url: str,
        sink: SampleSink,
        classes: Mapping[str, str],
        **options: Any,
    ) -> None:
        """``options``: those of ``MetricsScraper``."""
        super().__init__(url, sink, classes, **options)
        self.profile = profile
        self._rng = random.Random(0)  # pairs TPOTs: reproducible from one start
        self._first_tokens: dict[str, FirstTokensWaiting] = {}  # by model

    def parse(self, text: str) -> dict[str, EngineCounters]:
        return parse_engine_metrics(text, self.profile)

    def empty(self) -> EngineCounters:
        return EngineCounters()

    def samples_between(
        self, before: EngineCounters, after: EngineCounters, *, model: str, qos_class: str
    ) -> list[LatencySample]:
        return samples_between(
            before, after, model=model, qos_class=qos_class, profile=self.profile,
            max_samples=self.max_samples, rng=self._rng,
            first_tokens=self._first_tokens.setdefault(model, FirstTokensWaiting()),
        )  # fmt: skip
