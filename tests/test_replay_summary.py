"""benchmarks/replay_summary.py: the matrix's rows and the before-and-after comparison,
from results files written here in the layout qos_replay.py writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.replay_summary import against

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
