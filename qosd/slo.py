"""Latency windows: compliance and percentiles of a class's recent requests.

Model servers ``Report`` samples from every replica into one window per (pool,
class) in the store (the newest ``report.window_size``). This module reads the
evidence out of a window for the SLO loop and for operators:

- a sample *complies* when every latency it measured meets every objective set for
  its class (a latency it did not measure is not judged); a failed request
  (OUTCOME_ERROR) never complies; a cancelled one is left out, since the caller, not
  the server, ended it;
- compliance is the share of complying samples; a class without objectives has none;
- cut-offs select the evidence: samples *reported* after a time (the SLO loop's last
  change: what the server does now), or of requests *started* after it (a report's
  time less its latency, as reports come when requests end: requests admitted under
  the current rate); ``max_age`` keeps a quiet window from speaking for the present,
  and ``newest`` keeps only the latest, so a recovery already under way shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qosd.config import SloConfig
from qosd.model import Outcome, StoredSample


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
    has_slo: bool

    @property
    def compliance(self) -> float | None:
        """Share of samples within the SLO; None without objectives or samples."""
        if not self.has_slo or self.samples == 0:
            return None
        return self.compliant / self.samples


def pressure(stats: WindowStats, slo: SloConfig) -> float | None:
    """How close the typical request runs to its objectives: the largest p50 latency
    over its objective (1.0: half the requests at the limit). A trend to watch while
    compliance itself is pinned at 0 or 1."""
    ratios = [
        measured.p50 / objective
        for objective, measured in (
            (slo.ttft_ms, stats.ttft_ms),
            (slo.tpot_ms, stats.tpot_ms),
            (slo.e2e_ms, stats.e2e_ms),
        )
        if objective is not None and measured is not None
    ]
    return max(ratios) if ratios else None


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


def improving(older: WindowStats, newer: WindowStats, slo: SloConfig) -> bool:
    """Whether later-started requests fare better: more of them comply or, where
    compliance is pinned (all or none), their typical latency is lower."""
    if older.compliance is None or newer.compliance is None:
        return False
    if newer.compliance != older.compliance:
        return newer.compliance > older.compliance
    before, after = pressure(older, slo), pressure(newer, slo)
    return before is not None and after is not None and after < before


def _stats(samples: Sequence[StoredSample], slo: SloConfig) -> WindowStats:
    return WindowStats(
        samples=len(samples),
        compliant=sum(1 for s in samples if complies(s, slo)),
        ttft_ms=percentiles([s.ttft_ms for s in samples if s.ttft_ms is not None]),
        tpot_ms=percentiles([s.tpot_ms for s in samples if s.tpot_ms is not None]),
        e2e_ms=percentiles([s.e2e_ms for s in samples if s.e2e_ms is not None]),
        has_slo=has_objectives(slo),
    )


def has_objectives(slo: SloConfig) -> bool:
    return slo.ttft_ms is not None or slo.tpot_ms is not None or slo.e2e_ms is not None


def complies(sample: StoredSample, slo: SloConfig) -> bool:
    if sample.status == Outcome.ERROR:
        return False
    for objective, measured in (
        (slo.ttft_ms, sample.ttft_ms),
        (slo.tpot_ms, sample.tpot_ms),
        (slo.e2e_ms, sample.e2e_ms),
    ):
        if objective is not None and measured is not None and measured > objective:
            return False
    return True


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
