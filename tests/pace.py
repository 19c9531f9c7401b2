"""The daemon's own pace, for tests that bound how long a wait or an answer took.

A bound on time holds only on a machine that runs the daemon's timers on time; on a
busy one every timer of the daemon is late by its event loop's lag, and a test that
ignored it failed on a loaded CI machine with nothing wrong in qosd. The daemon
measures that lag itself (``qosd_event_loop_lag_seconds``, qosd.loop_lag), so a bound
can allow for the lag the daemon saw, and no more.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

LOOP_LAG = "qosd_event_loop_lag_seconds"


def worst_loop_lag_s(page: str) -> float:
    """At most how late the daemon's loop ran a timer, from its metrics page: the
    upper edge of the lowest bucket that holds every observation (inf if only the
    last does; 0 with none)."""
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(page):
        if family.name == LOOP_LAG:
            buckets = [
                (float(sample.labels["le"]), sample.value)
                for sample in family.samples
                if sample.name == f"{LOOP_LAG}_bucket"
            ]
    if not buckets:
        raise AssertionError(f"no {LOOP_LAG} on the page")
    buckets.sort()
    total = buckets[-1][1]  # the +Inf bucket: every observation
    if total == 0:
        return 0.0
    return next(edge for edge, count in buckets if count == total)


def scraped_loop_lag_s(http_address: str) -> float:
    """``worst_loop_lag_s`` of the daemon serving HTTP at ``host:port``."""
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as response:
        return worst_loop_lag_s(response.read().decode())
