"""A cell's policies on the plane an operator chooses on: P0 on time against the useful
work done, so that "qosd is better" means no baseline gets as much P0 and more work.

``frontier_of`` lists every policy of a cell (each point of static's capacity sweep
on its own) with its mean P0 attainment of offered and its mean trace goodput
(``trace_goodput_of_trace_saturated``), the worst seed's beside them, and whether any
other point beats it on both. ``headline_of`` picks the baseline to name beside qosd:
the best baseline at qosd's P0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUBJECT = "qosd"
#: How far below qosd's mean P0 a baseline may be and still count as "the same P0"
#: for the headline (one point: about one request in a hundred P0 requests).
SAME_P0 = 0.01


def _point(classes: Mapping[str, Any]) -> tuple[float | None, float | None]:
    return classes["P0"].get("attainment_of_offered"), classes["all"].get(
        "trace_goodput_of_trace_saturated"
    )


def frontier_of(
    policies: Mapping[str, Mapping[str, Any]], worst: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``{policy, capacity_factor, name, P0, goodput, P0_worst, goodput_worst,
    pareto_optimal}`` for every policy of the means ``policies`` (and their ``worst``
    seeds); a point is Pareto-optimal when no other is at least as good on both and
    better on one."""
    entries = []
    for name, classes in policies.items():
        policy, _, factor = name.partition("@")
        p0, goodput = _point(classes)
        entries.append(
            {
                "policy": policy,
                "capacity_factor": float(factor) if factor else None,
                "name": name,
                "P0": p0,
                "goodput": goodput,
                "P0_worst": worst.get(name, {}).get("P0", {}).get("attainment_of_offered"),
                "goodput_worst": worst.get(name, {})
                .get("all", {})
                .get("trace_goodput_of_trace_saturated"),
            }
        )
    for entry in entries:
        entry["pareto_optimal"] = not any(_dominates(other, entry) for other in entries)
    return entries


def _dominates(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if None in (a["P0"], a["goodput"], b["P0"], b["goodput"]):
        return False
    at_least: bool = a["P0"] >= b["P0"] and a["goodput"] >= b["goodput"]
    better: bool = a["P0"] > b["P0"] or a["goodput"] > b["goodput"]
    return at_least and better


def headline_of(results: Mapping[str, Any]) -> dict[str, Any] | None:
    """qosd's P0 and trace goodput, and the best baseline at the same P0: of those
    within ``SAME_P0`` of qosd's P0 or above it, the one with the most goodput; where
    none is, the one with the most P0. With its paired interval of qosd minus it."""
    points = {entry["name"]: entry for entry in results["frontier"]}
    mine = points.get(SUBJECT)
    if mine is None or mine["P0"] is None:
        return None
    others = [e for e in points.values() if e["name"] != SUBJECT and e["P0"] is not None]
    if not others:
        return None
    level = [e for e in others if e["P0"] >= mine["P0"] - SAME_P0 and e["goodput"] is not None]
    if level:
        chosen = max(level, key=lambda e: e["goodput"])
        rule = f"the most goodput of the baselines within {SAME_P0:.0%} of qosd's P0 or above"
    else:
        chosen = max(others, key=lambda e: e["P0"])
        rule = "no baseline reaches qosd's P0: the one with the most P0"
    return {
        "qosd": {"P0": mine["P0"], "goodput": mine["goodput"]},
        "baseline": chosen["name"],
        "baseline_P0": chosen["P0"],
        "baseline_goodput": chosen["goodput"],
        "rule": rule,
        "interval": results.get("intervals", {}).get(chosen["name"]),
    }
