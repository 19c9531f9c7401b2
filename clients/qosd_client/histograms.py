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
