"""Latency samples from a Prometheus histogram's bucket counts between two reads.

A server's histogram keeps cumulative counts per upper bound (``le``). Between two
reads, the difference per bucket is how many observations fell in it; the scrapers
turn those into as many values as they report, spread over the buckets in
proportion to their counts and, within a bucket, evenly between its bounds (the
linear interpolation that Prometheus's ``histogram_quantile`` also assumes). The
``+Inf`` bucket has no upper bound: its values are put at twice the last finite
bound, a guess that only the tail past the server's largest bucket ever gets.

What that costs against per-request samples is measured in ``docs/integrations.md``
(``benchmarks/histogram_samples.py``): within a bucket the values are evenly spaced,
not where the requests were, so a percentile is off by at most its bucket's width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: Cumulative counts by upper bound (math.inf for ``+Inf``), as one read saw them.
Cumulative = Mapping[float, float]


@dataclass(frozen=True, slots=True)
class Bucket:
    """Observations between two reads that fell in ``(lower, upper]``."""

    lower: float
    upper: float
    count: float


def counts_went_down(before: Cumulative, after: Cumulative) -> bool:
    """A bucket's count fell: the server restarted between the reads, and ``after``
    counts from zero."""
    return any(after.get(bound, 0.0) < count for bound, count in before.items())


def bucket_deltas(before: Cumulative, after: Cumulative, *, reset: bool = False) -> list[Bucket]:
    """The observations per bucket between two reads; ``reset``: the server restarted
    between them, and ``after`` is all there is."""
    buckets: list[Bucket] = []
    lower = 0.0
    previous = 0.0
    for bound in sorted(after):
        cumulative = after[bound] if reset else max(0.0, after[bound] - before.get(bound, 0.0))
        count = cumulative - previous
        previous = max(previous, cumulative)
        if count > 0:
            buckets.append(Bucket(lower, bound, count))
        lower = bound
    return buckets


def spread(buckets: list[Bucket], count: int, *, within: str = "interpolate") -> list[float]:
    """``count`` values, ascending, distributed over ``buckets`` in proportion to their
    counts: the i-th value is at quantile ``(i + 0.5) / count`` of the observations.

    ``within``: ``interpolate`` puts it between its bucket's bounds in proportion to
    its place in the bucket; ``upper`` at the bucket's upper bound (pessimistic; what
    the benchmark compares against)."""
    total = sum(bucket.count for bucket in buckets)
    if not buckets or total <= 0 or count <= 0:
        return []
    values: list[float] = []
    below = 0.0  # observations in the buckets before ``index``
    index = 0
    for i in range(count):
        quantile = (i + 0.5) / count * total
        while index < len(buckets) - 1 and below + buckets[index].count < quantile:
            below += buckets[index].count
            index += 1
        bucket = buckets[index]
        upper = bucket.upper
        if not math.isfinite(upper):  # +Inf: twice the last finite bound
            upper = 2 * bucket.lower if bucket.lower > 0 else 1.0
        if within == "upper":
            values.append(upper)
        else:
            share = min(1.0, max(0.0, (quantile - below) / bucket.count))
            values.append(bucket.lower + (upper - bucket.lower) * share)
    return values


#: Less than this of an observation is none (what proportional shares leave over).
_NOTHING = 1e-9


class FirstTokensWaiting:
    """First tokens whose requests have not finished, per TTFT bucket, as fractions
    of observations: a read that shows first tokens and no finishes (or fewer) keeps
    them for the finishes of later reads, which take a share in proportion to how
    many finished (the requests that finish are not known by name, so each takes
    the waiting distribution). First tokens of requests that never finish (aborted,
    failed, cancelled, where the engine counts no end for them) would stay for good:
    past ``limit`` observations, more than an engine runs at once, the oldest and the
    newest alike are scaled down to it, so they never grow without bound."""

    #: More first tokens than an engine has requests running (vLLM's max_num_seqs
    #: defaults to 256 to 1,024).
    LIMIT = 4_096.0

    def __init__(self) -> None:
        self._counts: dict[tuple[float, float], float] = {}

    @property
    def count(self) -> float:
        return sum(self._counts.values())

    def add(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            key = (bucket.lower, bucket.upper)
            self._counts[key] = self._counts.get(key, 0.0) + bucket.count
        total = self.count
        if total > self.LIMIT:
            scale = self.LIMIT / total
            self._counts = {key: count * scale for key, count in self._counts.items()}

    def take(self, finished: float) -> list[Bucket]:
        """The share of the waiting first tokens that ``finished`` requests take."""
        total = self.count
        if total <= 0 or finished <= 0:
            return []
        share = min(1.0, finished / total)
        taken = [Bucket(lower, upper, count * share)
                 for (lower, upper), count in sorted(self._counts.items())]  # fmt: skip
        self._counts = {key: count * (1 - share) for key, count in self._counts.items()
                        if count * (1 - share) > _NOTHING}  # fmt: skip
        return taken

    def clear(self) -> None:
        self._counts.clear()
