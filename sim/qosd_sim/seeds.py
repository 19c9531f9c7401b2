"""Several seeds of one benchmark cell, summed up: the mean of every figure, and the
worst seed of the figures the goals are judged on.

A single run per cell hides how much of a lead is luck (on the Mooncake trace a
seed holds 12 to 34 P0 requests, so one request is three to eight points). The benchmark
runs each cell under ten seeds, and writes each seed's results whole (``per_seed``),
their means in the usual layout, the worst seed beside them, and paired bootstrap
intervals of qosd's lead over each baseline (``paired_intervals``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import bootstrap

#: Seeds the results in docs/ report. Designs are chosen on ``DEVELOPMENT_SEEDS``
#: (and were on seed 7 in earlier rounds), never on these. Issue 26's figures were
#: iterated on seed 11, so 11 to 13 are development seeds for that change alone; its
#: pair is re-run on ``RECHECK_SEEDS``, which nothing was ever looked at on.
REPORTED_SEEDS = tuple(range(11, 21))
DEVELOPMENT_SEEDS = (1, 2, 3)
RECHECK_SEEDS = tuple(range(21, 31))

#: Per class, the figures whose worst seed is reported: each is better when higher.
WORST_OF = {
    "P0": ("attainment_of_offered", "slo_attainment", "fraction_of_bound"),
    "P1": ("attainment_of_offered", "slo_attainment"),
    "P2": ("attainment_of_offered",),
    "all": (
        "attainment_of_offered",
        "goodput_span_of_saturated",
        "trace_goodput_span_of_saturated",
        "trace_goodput_of_trace_saturated",
    ),
}
#: Figures whose worst seed is the highest.
WORST_HIGH = {"P2": ("waits_past_max",)}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def mean(values: Sequence[Any]) -> Any:
    """The mean of numbers (None where a seed has none is left out; None if all are);
    flags raised if any seed raised them (a run marked late in one seed marks the
    cell); dictionaries key by key (counts of refusal reasons are summed, as totals);
    any other value as the first seed has it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, bool) for v in present):
        return any(present)
    if all(_number(v) for v in present):
        return round(statistics.fmean(present), 4)
    if all(isinstance(v, Mapping) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {key: mean([v.get(key) for v in present]) for key in keys}
    return present[0]


def worst(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{policy: {class: {figure: worst seed's value}}}`` over ``per_seed``'s policies."""
    policies = per_seed[0]["policies"]
    out: dict[str, Any] = {}
    for policy in policies:
        out[policy] = {}
        for name in policies[policy]:
            figures: dict[str, Any] = {}
            for figure in WORST_OF.get(name, ()):
                values = [s["policies"][policy][name].get(figure) for s in per_seed]
                present = [v for v in values if v is not None]
                figures[figure] = min(present) if present else None
            for figure in WORST_HIGH.get(name, ()):
                values = [s["policies"][policy][name].get(figure) for s in per_seed]
                present = [v for v in values if v is not None]
                figures[figure] = max(present) if present else None
            out[policy][name] = figures
    return out


def summed_up(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The means (``policies``, ``bound``, ``workload_shape``) and the worst seed
    (``worst``) of several seeds' results, and the same of P0 under the fixed-500 ms
    scoring (``fixed_p0``)."""
    fixed = [{"policies": s["fixed_p0"]} for s in per_seed]
    return {
        "policies": mean([s["policies"] for s in per_seed]),
        "worst": worst(per_seed),
        "fixed_p0": {"policies": mean([s["policies"] for s in fixed]), "worst": worst(fixed)},
        "bound": {
            scoring: {
                "P0": mean([s["bound"][scoring]["P0"]["share"] for s in per_seed]),
                "P0_worst": min(
                    (s["bound"][scoring]["P0"]["share"] for s in per_seed),
                    default=None,
                    key=lambda v: 2.0 if v is None else v,
                ),
            }
            for scoring in per_seed[0]["bound"]
        },
        "workload_shape": mean([s["workload_shape"] for s in per_seed]),
    }


#: The figures ``paired_intervals`` compares, as (class, field) of a seed's policy.
INTERVAL_FIGURES: dict[str, tuple[str, str]] = {
    "P0": ("P0", "attainment_of_offered"),
    "goodput": ("all", "trace_goodput_of_trace_saturated"),
}


def paired_intervals(
    per_seed: Sequence[Mapping[str, Any]],
    subject: str = "qosd",
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
) -> dict[str, Any]:
    """``{baseline: {figure: {mean, low, high, seeds}}}``: the subject's lead over
    each other policy (subject minus baseline) on each of ``INTERVAL_FIGURES``, the
    mean over seeds and its paired percentile bootstrap interval (SciPy's, resampling
    seeds with replacement; seeded, so a rerun on the same results gives the same
    interval). A seed where either side lacks the figure is left out."""
    policies = per_seed[0]["policies"] if per_seed else {}
    if subject not in policies:
        return {}
    out: dict[str, Any] = {}
    for baseline in (p for p in policies if p != subject):
        out[baseline] = {}
        for figure, (name, field) in INTERVAL_FIGURES.items():
            mine = _figures(per_seed, subject, name, field)
            theirs = _figures(per_seed, baseline, name, field)
            diffs = [
                a - b for a, b in zip(mine, theirs, strict=True) if a is not None and b is not None
            ]
            out[baseline][figure] = _interval(diffs, confidence, resamples)
    return out


def _figures(
    per_seed: Sequence[Mapping[str, Any]], policy: str, name: str, field: str
) -> list[float | None]:
    return [s["policies"].get(policy, {}).get(name, {}).get(field) for s in per_seed]


def _interval(diffs: Sequence[float], confidence: float, resamples: int) -> dict[str, Any]:
    if not diffs:
        return {"mean": None, "low": None, "high": None, "seeds": 0}
    centre = statistics.fmean(diffs)
    if len(diffs) < 2 or max(diffs) == min(diffs):  # nothing to resample
        low = high = centre
    else:
        result = bootstrap(
            (np.array(diffs),),
            np.mean,
            confidence_level=confidence,
            n_resamples=resamples,
            method="percentile",
            random_state=np.random.default_rng(0),
        )
        low, high = result.confidence_interval.low, result.confidence_interval.high
    return {"mean": round(centre, 4), "low": round(float(low), 4),
            "high": round(float(high), 4), "seeds": len(diffs)}  # fmt: skip
