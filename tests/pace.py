"""The daemon's own pace, for tests that bound how long a wait or an answer took.

A bound on time holds only on a machine that runs the daemon's timers on time; on a
busy one every timer of the daemon is late by its event loop's lag, and a test that
ignored it failed on a loaded CI machine with nothing wrong in qosd. The daemon
measures that lag itself (``qosd_event_loop_lag_seconds``, qosd.loop_lag), so a bound
can allow for the lag the daemon saw while the test ran, and no more: the lag over
the window is the difference of two pages' histograms.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

LOOP_LAG = "qosd_event_loop_lag_seconds"


def lag_buckets(page: str) -> dict[float, float]:
    """The lag histogram's cumulative buckets on a metrics page: upper edge -> count."""
    for family in text_string_to_metric_families(page):
        if family.name == LOOP_LAG:
            return {
                float(sample.labels["le"]): sample.value
                for sample in family.samples
                if sample.name == f"{LOOP_LAG}_bucket"
            }
    raise AssertionError(f"no {LOOP_LAG} on the page")


def worst_loop_lag_s(after: str, before: str | None = None) -> float:
    """At most how late the daemon's loop ran a timer between the pages ``before`` (None:
    its start) and ``after``: the upper edge of the lowest bucket that holds every
    observation made between them (0 with none; inf if only the last holds them)."""
    counts = lag_buckets(after)
    if before is not None:
        earlier = lag_buckets(before)
        counts = {edge: count - earlier.get(edge, 0.0) for edge, count in counts.items()}
    edges = sorted(counts)
    total = counts[edges[-1]]  # the +Inf bucket: every observation
    if total == 0:
        return 0.0
    return next(edge for edge in edges if counts[edge] == total)


def metrics_page(http_address: str) -> str:
    """The metrics page of the daemon serving HTTP at ``host:port``."""
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text
