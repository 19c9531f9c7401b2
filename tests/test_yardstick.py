"""Issue 37's yardstick from results files' figures: paired intervals over seeds, the
frontier of policies, and the baseline named beside qosd."""

from __future__ import annotations

from typing import Any

import pytest

from qosd_sim.frontier import frontier_of, headline_of
from qosd_sim.seeds import mean, paired_intervals

pytestmark = pytest.mark.fast


def figures(p0: float | None, goodput: float | None) -> dict[str, Any]:
    return {
        "P0": {"attainment_of_offered": p0},
        "all": {"trace_goodput_of_trace_saturated": goodput},
    }


def seeds(policies: dict[str, list[tuple[float | None, float | None]]]) -> list[dict[str, Any]]:
    """Per-seed results: ``{name: [(P0, goodput) for each seed]}``."""
    count = len(next(iter(policies.values())))
    return [
        {"policies": {name: figures(*values[i]) for name, values in policies.items()}}
        for i in range(count)
    ]


def test_a_lead_in_every_seed_has_an_interval_above_zero() -> None:
    per_seed = seeds(
        {
            "qosd": [(0.50, 0.60), (0.55, 0.62), (0.60, 0.58), (0.52, 0.61)],
            "fifo-deadline": [(0.30, 0.60), (0.35, 0.70), (0.42, 0.50), (0.30, 0.61)],
        }
    )
    interval = paired_intervals(per_seed)["fifo-deadline"]
    p0, goodput = interval["P0"], interval["goodput"]
    assert p0["mean"] == pytest.approx(0.2) and p0["seeds"] == 4
    assert 0 < p0["low"] <= p0["mean"] <= p0["high"] <= 0.22
    # Goodput: ahead in some seeds, behind in others: the interval holds zero.
    assert goodput["low"] < 0 < goodput["high"]
    # Seeded: the same figures, the same interval.
    assert paired_intervals(per_seed) == paired_intervals(per_seed)


def test_seeds_without_a_figure_are_left_out_and_no_qosd_is_no_interval() -> None:
    per_seed = seeds({"qosd": [(0.5, None), (0.6, 0.7)], "static@1.0": [(0.4, 0.6), (0.4, 0.6)]})
    interval = paired_intervals(per_seed)["static@1.0"]
    assert interval["P0"]["seeds"] == 2 and interval["goodput"]["seeds"] == 1
    assert interval["goodput"] == {"mean": 0.1, "low": 0.1, "high": 0.1, "seeds": 1}
    assert paired_intervals(seeds({"static@1.0": [(0.4, 0.6)]})) == {}


def test_the_frontier_marks_what_no_other_point_beats_on_both() -> None:
    means = {
        "qosd": figures(0.80, 0.55),
        "static@0.6": figures(0.70, 0.40),  # beaten by qosd on both
        "static@1.0": figures(0.50, 0.65),
        "vllm-native": figures(0.80, 0.50),  # as much P0 as qosd, less goodput
    }
    worst = {name: figures(0.1, 0.1) for name in means}
    points = {entry["name"]: entry for entry in frontier_of(means, worst)}
    assert points["static@0.6"] == {
        "policy": "static", "capacity_factor": 0.6, "name": "static@0.6", "P0": 0.70,
        "goodput": 0.40, "P0_worst": 0.1, "goodput_worst": 0.1, "pareto_optimal": False,
    }  # fmt: skip
    assert [n for n, e in points.items() if e["pareto_optimal"]] == ["qosd", "static@1.0"]
    assert points["qosd"]["capacity_factor"] is None


def test_the_headline_names_the_best_baseline_at_qosds_p0() -> None:
    means = {
        "qosd": figures(0.80, 0.55),
        "static@0.6": figures(0.795, 0.60),  # within a point of qosd's P0, more goodput
        "static@1.0": figures(0.50, 0.70),  # more goodput, far less P0
        "vllm-native": figures(0.90, 0.45),
    }
    results = {
        "frontier": frontier_of(means, {}),
        "intervals": {"static@0.6": {"P0": {"mean": 0.005}}},
    }
    head = headline_of(results)
    assert head is not None
    assert head["baseline"] == "static@0.6" and head["interval"] == {"P0": {"mean": 0.005}}
    # No baseline within reach of qosd's P0: the one with the most P0 is named.
    means["static@0.6"] = figures(0.60, 0.60)
    means["vllm-native"] = figures(0.70, 0.45)
    head = headline_of({"frontier": frontier_of(means, {})})
    assert head is not None and head["baseline"] == "vllm-native"
    assert "no baseline reaches" in head["rule"]


def test_a_run_marked_late_in_one_seed_marks_the_cells_mean() -> None:
    """A flag in the seeds' means is raised if any seed raised it: the mean table must
    not show a cell as on schedule because its first seed was."""
    seeds_flags = [{"late_run": False, "gpu_lost_s": 0.0}, {"late_run": True, "gpu_lost_s": 1.0}]
    assert mean(seeds_flags) == {"late_run": True, "gpu_lost_s": 0.5}
    assert mean([{"late_run": False}, {"late_run": None}]) == {"late_run": False}
