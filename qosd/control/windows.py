"""Latency windows: compliance and percentiles of a class's recent requests.

Model servers ``Report`` samples from every replica into one window per (pool,
class) in the store (the newest ``report.window_size``). This module reads the
evidence out of a window for the SLO loop and for operators:

- a sample's *objectives* are its own (those its request stated, ``slo_ttft_ms`` and
  ``slo_tpot_ms``), else its class's, with the TTFT objective scaled by its prompt
  length (``request_objectives``, the one definition of a request's objectives);
- a sample *complies* when every latency it measured meets every objective it has (a
  latency it did not measure is not judged, and a sample with no objectives complies
  by being served); a failed request (OUTCOME_ERROR) never complies; a cancelled one
  is left out, since the caller, not the server, ended it;
- compliance is the share of complying samples; a window none of whose samples has
  an objective (a class without objectives whose requests stated none) has none;
- cut-offs select the evidence: samples *reported* after a time (the SLO loop's last
  change: what the server does now), or of requests *started* after it (a report's
  time less its latency, as reports come when requests end: requests admitted under
  the current rate); ``max_age`` keeps a quiet window from speaking for the present,
  and ``newest`` keeps only the latest, so a recovery already under way shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from qosd.config import SloConfig
from qosd.model import Outcome, StoredSample


class Measured(Protocol):
    """What judging a sample reads: a sample as Report received it (``model.Sample``)
    or as a window holds it (``model.StoredSample``)."""

    @property
    def ttft_ms(self) -> float | None: ...
    @property
    def tpot_ms(self) -> float | None: ...
    @property
    def e2e_ms(self) -> float | None: ...
    @property
    def input_tokens(self) -> int: ...
    @property
    def status(self) -> Outcome: ...
    @property
    def slo_ttft_ms(self) -> float | None: ...
    @property
    def slo_tpot_ms(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Objectives:
    """The latency objectives one request is judged against, ms; None: not judged."""

    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None or self.e2e_ms is not None


def request_objectives(
    slo: SloConfig,
    input_tokens: int,
    *,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
) -> Objectives:
    """The objectives of one request of a class with objectives ``slo`` and a prompt of
    ``input_tokens`` tokens; ``ttft_ms`` and ``tpot_ms`` are those the request stated
    itself (None: not stated).

    - TTFT: the stated objective, as stated; else the class's ``ttft_ms`` plus
      ``ttft_ms_per_1k_tokens`` for every 1,000 prompt tokens beyond
      ``ttft_free_tokens`` (a prompt within them keeps the base); None when neither;
    - TPOT: the stated objective, else the class's;
    - end to end: the class's.

    The windows' compliance, the SLO loop and GetStatus judge through it; so should
    anything else that scores requests against their objectives (a benchmark).
    """
    ttft = ttft_ms
    if ttft is None and slo.ttft_ms is not None:
        ttft = slo.ttft_ms
        beyond = input_tokens - slo.ttft_free_tokens
        if beyond > 0 and slo.ttft_ms_per_1k_tokens:
            ttft += slo.ttft_ms_per_1k_tokens * beyond / 1000
    return Objectives(ttft, slo.tpot_ms if tpot_ms is None else tpot_ms, slo.e2e_ms)


def sample_objectives(sample: Measured, slo: SloConfig) -> Objectives:
    """A stored sample's objectives: those it reported, else its class's for its prompt."""
    return request_objectives(
        slo, sample.input_tokens, ttft_ms=sample.slo_ttft_ms, tpot_ms=sample.slo_tpot_ms
    )


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50: float
    p95: float
    p99: float


@dataclass(frozen=True, slots=True)
class WindowStats:
    samples: int  # samples judged
    compliant: int
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None
    e2e_ms: Percentiles | None
    has_slo: bool  # some sample judged has an objective (its own or its class's)
    # The largest, over TTFT, TPOT and end to end, of the median latency relative to
    # each sample's own objective; None: nothing measured against an objective.
    pressure: float | None = None
    # The 95th percentile, over samples, of each sample's worst latency relative to
    # its own objective: how close the slow requests run to their limits (0.8: 95 %
    # of requests within 80 % of every objective). None: nothing measured.
    tail_pressure: float | None = None

    @property
    def compliance(self) -> float | None:
        """Share of samples within the SLO; None without objectives or samples."""
        if not self.has_slo or self.samples == 0:
            return None
        return self.compliant / self.samples


def pressure(stats: WindowStats, slo: SloConfig | None = None) -> float | None:
    """How close the typical request runs to its objectives: the largest median, over
    the latencies, of each sample's latency over its own objective (1.0: half the
    requests at the limit). A trend to watch while compliance itself is pinned at 0 or
    1. (``slo`` is not needed: each sample's objectives were applied in ``_stats``.)"""
    return stats.pressure


def trend(
    samples: Sequence[StoredSample], slo: SloConfig, *, reported_after: int
) -> tuple[WindowStats, WindowStats] | None:
    """The earlier-started half and the later-started half of the requests reported
    after ``reported_after``: the later fare better while a server recovers (its
    backlog drains, a burst passes) and no better while the load stays too high."""
    recent = sorted(
        (s for s in samples if s.at_ms > reported_after and s.status != Outcome.CANCELLED),
        key=started_ms,
    )
    if len(recent) < 4:
        return None
    half = len(recent) // 2
    return _stats(recent[:half], slo), _stats(recent[half:], slo)


def improving(older: WindowStats, newer: WindowStats, slo: SloConfig | None = None) -> bool:
    """Whether later-started requests fare better: more of them comply or, where
    compliance is pinned (all or none), their typical latency is lower."""
    if older.compliance is None or newer.compliance is None:
        return False
    if newer.compliance != older.compliance:
        return newer.compliance > older.compliance
    before, after = older.pressure, newer.pressure
    return before is not None and after is not None and after < before


def _stats(samples: Sequence[StoredSample], slo: SloConfig) -> WindowStats:
    compliant = 0
    has_slo = has_objectives(slo)
    ratios: tuple[list[float], list[float], list[float]] = ([], [], [])
    worst: list[float] = []  # per sample, its largest latency / objective
    for sample in samples:
        objectives = sample_objectives(sample, slo)
        has_slo = has_slo or objectives.any
        compliant += complies(sample, objectives)
        sample_worst: float | None = None
        for ratio, objective, measured in zip(
            ratios,
            (objectives.ttft_ms, objectives.tpot_ms, objectives.e2e_ms),
            (sample.ttft_ms, sample.tpot_ms, sample.e2e_ms),
            strict=True,
        ):
            if objective is not None and measured is not None:
                ratio.append(measured / objective)
                sample_worst = max(sample_worst or 0.0, measured / objective)
        if sample_worst is not None:
            worst.append(sample_worst)
    medians = [p.p50 for p in map(percentiles, ratios) if p is not None]
    tail = percentiles(worst)
    return WindowStats(
        samples=len(samples),
        compliant=compliant,
        ttft_ms=percentiles([s.ttft_ms for s in samples if s.ttft_ms is not None]),
        tpot_ms=percentiles([s.tpot_ms for s in samples if s.tpot_ms is not None]),
        e2e_ms=percentiles([s.e2e_ms for s in samples if s.e2e_ms is not None]),
        has_slo=has_slo,
        pressure=max(medians) if medians else None,
        tail_pressure=tail.p95 if tail is not None else None,
    )


def has_objectives(slo: SloConfig) -> bool:
    return slo.ttft_ms is not None or slo.tpot_ms is not None or slo.e2e_ms is not None


def complies(sample: Measured, objectives: Objectives) -> bool:
    """Whether the sample met every objective it has (``sample_objectives``)."""
    if sample.status == Outcome.ERROR:
        return False
    for objective, measured in (
        (objectives.ttft_ms, sample.ttft_ms),
        (objectives.tpot_ms, sample.tpot_ms),
        (objectives.e2e_ms, sample.e2e_ms),
    ):
        if objective is not None and measured is not None and measured > objective:
            return False
    return True


def verdict(sample: Measured, slo: SloConfig) -> bool | None:
    """One sample judged as the windows judge it: whether it met its objectives; None
    when it is not judged (cancelled, or with no objective, its own or its class's).
    ``qosd_slo_samples_total`` counts by it, so a burn rate from that counter and the
    window's compliance ratio agree on what a miss is."""
    if sample.status == Outcome.CANCELLED:
        return None
    objectives = sample_objectives(sample, slo)
    return complies(sample, objectives) if objectives.any else None


def started_ms(sample: StoredSample) -> float:
    """When the request started: reported at its end, less its latency."""
    latency = sample.e2e_ms if sample.e2e_ms is not None else (sample.ttft_ms or 0.0)
    return sample.at_ms - latency


def percentiles(values: list[float]) -> Percentiles | None:
    """Nearest-rank percentiles: each is a latency some request really had."""
    if not values:
        return None
    ordered = sorted(values)
    last = len(ordered) - 1

    def rank(q: float) -> float:
        return ordered[min(last, max(0, int(q * len(ordered) + 0.999999) - 1))]

    return Percentiles(rank(0.50), rank(0.95), rank(0.99))


def window_stats(
    samples: Sequence[StoredSample],
    slo: SloConfig,
    *,
    reported_after: int = 0,
    started_after: int | None = None,
    now_ms: int | None = None,
    max_age_ms: int | None = None,
    newest: int | None = None,
) -> WindowStats:
    """Statistics of the samples reported after ``reported_after`` (and within
    ``max_age_ms`` of ``now_ms``), of requests started after ``started_after`` if set,
    the ``newest`` of them (windows are newest first)."""
    after = reported_after
    if max_age_ms is not None and now_ms is not None:
        after = max(after, now_ms - max_age_ms)
    judged = [
        s
        for s in samples
        if s.at_ms > after
        and (started_after is None or started_ms(s) > started_after)
        and s.status != Outcome.CANCELLED
    ][:newest]
    return _stats(judged, slo)
