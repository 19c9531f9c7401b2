"""The Grafana dashboard (helm/qosd/dashboards/qosd.json): the checked-in JSON is what
scripts/gen_dashboard.py generates now, and its panels read qosd's own metrics through
the pool and class variables. tests/test_monitoring_prometheus.py runs the queries."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "qosd" / "dashboards" / "qosd.json"


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel that is not a row."""
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def test_the_checked_in_dashboard_is_what_the_generator_writes() -> None:
    checked = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr


def test_panels_cover_what_an_operator_watches() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["pool"]["query"].startswith("label_values(")
    assert variables["class"]["query"].startswith("label_values(")
    assert variables["pool"]["multi"] and variables["class"]["includeAll"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = {panel["title"] for panel in board["panels"]}
    for wanted in (
        "Decisions by class and reason",
        "Queue depth",
        "Time in the waiting room",
        "Queue timeouts",
        "Compliance against objectives",
        "Error budget burn rate",
        "Admitted rate R",
        "Rate adjustments",
        "Leases in flight against the bound",
        "Store call latency",
        "Store errors and resets",
        "Config reloads",
        "Auth refusals",
        "Fail-mode answers",
    ):
        assert wanted in titles
    for title, expr in panel_queries(board):
        assert re.search(r"\bqosd[_:]", expr), title
        if "pool=~" in expr:
            assert '"$pool"' in expr, title
