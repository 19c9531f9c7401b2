"""benchmarks/replay_summary.py: the matrix's rows and the before-and-after comparison,
from results files written here in the layout qos_replay.py writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.replay_summary import against, cell_table

pytestmark = pytest.mark.fast


def cell(per_seed_p0: dict[int, float]) -> dict[str, Any]:
    """A results file's per-seed part: qosd's P0, P1 and goodput for each seed."""

    def figures(p0: float) -> dict[str, Any]:
        return {
            "P0": {"attainment_of_offered": p0},
            "P1": {"attainment_of_offered": 0.5},
            "all": {"goodput_span_of_saturated": 0.6},
        }

    return {
        "policies": {"qosd": figures(0.0)},
        "per_seed": [
            {"seed": seed, "policies": {"qosd": figures(p0)}} for seed, p0 in per_seed_p0.items()
        ],
    }


def test_against_shows_each_seed_the_change_and_the_old_spread(tmp_path: Path) -> None:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(cell({11: 0.20, 12: 0.10, 13: 0.30})))
    new.write_text(json.dumps(cell({11: 0.25, 12: 0.10, 13: 0.30})))
    text = against(new, old)
    p0 = next(line for line in text.splitlines() if "| P0 on time |" in line)
    assert "11: 0.250 / 0.200" in p0
    assert "0.217 / 0.200 (+0.017)" in p0  # the means, and the change
    assert p0.endswith("| 0.200 |")  # the old seeds' spread: 0.30 - 0.10
    unchanged = next(line for line in text.splitlines() if "| P1 of offered |" in line)
    assert "(+0.000)" in unchanged


def test_against_compares_only_the_seeds_both_ran(tmp_path: Path) -> None:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(cell({11: 0.2, 12: 0.4})))
    new.write_text(json.dumps(cell({12: 0.4, 99: 1.0})))
    p0 = next(line for line in against(new, old).splitlines() if "| P0 on time |" in line)
    assert "12: 0.400 / 0.400" in p0 and "99:" not in p0


def yardstick_cell() -> dict[str, Any]:
    """A yardstick cell's summary part: qosd and one static point, as qos_replay writes."""

    def policy(p0: float, goodput: float, p1: float, online: float) -> dict[str, Any]:
        return {
            "P0": {"attainment_of_offered": p0, "fraction_of_online": online},
            "P1": {"attainment_of_offered": p1},
            "all": {"trace_goodput_of_trace_saturated": goodput},
        }

    def worst(p0: float, goodput: float) -> dict[str, Any]:
        return {
            "P0": {"attainment_of_offered": p0},
            "all": {"trace_goodput_of_trace_saturated": goodput},
        }

    return {
        "trace": "traces/azure2023_conv.csv",
        "load": 2.0,
        "engine": "chunked",
        "bursty": False,
        "policies": {
            "qosd": policy(0.9, 0.6, 0.3, 0.95),
            "static@1": policy(0.8, 0.7, 0.5, 0.84),
        },
        "worst": {"qosd": worst(0.85, 0.55), "static@1": worst(0.7, 0.65)},
        "frontier": [
            {"name": "qosd", "P0": 0.9, "goodput": 0.6, "pareto_optimal": True},
            {"name": "static@1", "P0": 0.8, "goodput": 0.7, "pareto_optimal": True},
        ],
        "intervals": {
            "static@1": {
                "P0": {"mean": 0.1, "low": 0.05, "high": 0.15},
                "goodput": {"mean": -0.1, "low": -0.12, "high": -0.08},
            }
        },
        "references": {"P0_online": {"P0": 0.95}, "P0_clairvoyant": {"P0": 0.97}},
        "bound": {"scaled": {"P0": 0.99}},
    }


def test_a_cell_table_shows_every_policy_its_worst_seed_and_interval(tmp_path: Path) -> None:
    path = tmp_path / "yardstick_azure_2x_chunked.json"
    path.write_text(json.dumps(yardstick_cell()))
    lines = cell_table(path).splitlines()
    assert lines[0].startswith("**azure 2x chunked** ([JSON](results/yardstick_azure_2x_chunked")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert rows["qosd"] == "| qosd | 90.0 % (85.0 %) | 0.95 | 0.600 (0.550) | 30.0 % | yes |  |  |"
    assert rows["static@1"] == (
        "| static@1 | 80.0 % (70.0 %) | 0.84 | 0.700 (0.650) | 50.0 % | yes "
        "| +0.100 [+0.050, +0.150] | -0.100 [-0.120, -0.080] |"
    )
    assert lines[-1] == (
        "P0 alone: online reference 95.0 %, the bound's set replayed 97.0 %, proven bound 99.0 %."
    )
