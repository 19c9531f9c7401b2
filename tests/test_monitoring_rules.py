"""The alert rules (helm/qosd/rules/qosd-alerts.yaml): promtool accepts them, its unit
tests (tests/data/qosd-alerts.test.yaml) pass and cover every alert firing and not
firing, and every alert's runbook is a section of docs/observability.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "helm" / "qosd" / "rules" / "qosd-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "data" / "qosd-alerts.test.yaml"
RUNBOOKS = ROOT / "docs" / "observability.md"
RUNBOOK_URL = "https://github.com/qosd/qosd/blob/main/docs/observability.md#"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is needed (scripts/system_packages.sh installs it)"
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_promtool_unit_tests_pass() -> None:
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert len(names) >= 8
    assert names - firing == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested silent (exp_alerts: [])"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("rule", alerts(), ids=lambda rule: rule["alert"])
def test_each_alert_has_a_runbook_section(rule: dict[str, Any]) -> None:
    url = rule["annotations"]["runbook_url"]
    assert url == RUNBOOK_URL + rule["alert"].lower()
    assert rule["alert"].lower() in _anchors(RUNBOOKS.read_text())
    assert rule["labels"]["severity"] in {"critical", "warning"}
