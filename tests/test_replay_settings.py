"""The replay benchmark's ``--set``: config overrides for the qosd policy, checked by
the daemon's own schema before any run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.qos_replay import config_settings
from qosd.config import Config
from qosd_sim.experiment import MODEL, Policy, daemon_config
from qosd_sim.gpu import GpuModel

GPU = GpuModel()


def qosd_config(overrides: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The qosd policy's config, as the benchmark builds it, with ``--set`` applied."""
    return daemon_config(
        Policy.QOSD, capacity_cost_s=10_000, output_weight=1.0, redis_url="", gpu=GPU,
        overrides=overrides,
    )  # fmt: skip


def test_a_pool_setting_reaches_the_simulated_pool_and_values_read_as_yaml() -> None:
    apply = config_settings(["pool.max_prefill_share=0.25", "control.enabled=false"])
    tree = qosd_config(apply)
    assert tree["pools"][MODEL]["max_prefill_share"] == 0.25
    assert tree["control"]["enabled"] is False
    assert Config.model_validate(tree).pools[MODEL].max_prefill_share == 0.25


def test_a_malformed_setting_is_refused_naming_it() -> None:
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        config_settings(["pool.max_prefill_share"])
    apply = config_settings(["nosuch.section.key=1"])
    with pytest.raises(SystemExit, match="no setting 'nosuch'"):
        qosd_config(apply)


def test_a_value_the_schema_refuses_fails_before_any_run() -> None:
    apply = config_settings(["pool.max_prefill_share=2"])
    with pytest.raises(ValueError, match="max_prefill_share"):
        qosd_config(apply)
