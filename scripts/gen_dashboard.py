#!/usr/bin/env python3
"""Writes qosd's Grafana dashboard, helm/qosd/dashboards/qosd.json, from the panels
declared here, with grafana-foundation-sdk's typed builders.

The JSON is checked in (the chart ships it as a ConfigMap for Grafana's sidecar, and
anyone can import it by hand); ``--check`` writes nothing and exits 1 when the
checked-in copy differs from what this generates (tests/test_monitoring_dashboard.py
runs it). tests/test_monitoring_prometheus.py runs every query below against a real
Prometheus scraping a live daemon. Panels that show burn rates read the recording
rules of helm/qosd/rules/qosd-alerts.yaml.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "helm" / "qosd" / "dashboards" / "qosd.json"
UID = "qosd-overview"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Selectors of the template variables (multi-valued, "All" matches everything).
POOL = 'pool=~"$pool"'
CLASS = f'{POOL}, class=~"$class"'
RATE = "[$__rate_interval]"
REJECTED = CLASS + ', decision="rejected"'
MET = CLASS + ', result="met"'
P99 = CLASS + ', percentile="p99"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]


def _sum_rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}{RATE}))"


def _decisions(selector: str, by: str) -> str:
    return _sum_rate("qosd_acquire_decisions_total", selector, by)


def _max(metric: str, selector: str, by: str) -> str:
    """A fleet-wide gauge: every replica reports the same value; show one."""
    return f"max by ({by}) ({metric}{{{selector}}})"


def _quantile(q: float, metric: str, selector: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}{RATE})))"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Decisions",
        (
            Panel(
                "Decisions by class and reason",
                "Acquire answers per second: admitted (reason NONE) or refused, and why.",
                "reqps",
                (Query(_decisions(CLASS, "class, decision, reason"), "{{class}} {{reason}}"),),
            ),
            Panel(
                "Refused share by class",
                "The share of each class's Acquires refused, whatever the reason.",
                "percentunit",
                (
                    Query(
                        f"{_decisions(REJECTED, 'class')} / {_decisions(CLASS, 'class')}",
                        "{{class}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Waiting room",
        (
            Panel(
                "Queue depth",
                "Acquires waiting for budget, fleet-wide (every replica reports the same).",
                "short",
                (Query(f"max by (class) (qosd_queue_depth{{{CLASS}}})", "{{class}}"),),
            ),
            Panel(
                "Time in the waiting room",
                "p50 and p99 of the wait of Acquires that waited, from the histogram.",
                "s",
                (
                    Query(
                        _quantile(0.5, "qosd_acquire_wait_seconds", CLASS, "class"),
                        "{{class}} p50",
                    ),
                    Query(
                        _quantile(0.99, "qosd_acquire_wait_seconds", CLASS, "class"),
                        "{{class}} p99",
                    ),
                ),
            ),
            Panel(
                "Queue timeouts",
                "Waiters that reached their max wait (QUEUE_TIMEOUT), per second.",
                "reqps",
                (Query(_decisions(CLASS + ', reason="QUEUE_TIMEOUT"', "class"), "{{class}}"),),
            ),
        ),
    ),
    (
        "Objectives",
        (
            Panel(
                "Compliance against objectives",
                "The share of each class's requests within their latency objectives: the "
                "window the SLO loop judges, the samples reported over the panel's "
                "interval, and the SLO target of the alert rules.",
                "percentunit",
                (
                    Query(
                        f"max by (class) (qosd_slo_compliance_ratio{{{CLASS}}})", "{{class}} window"
                    ),
                    Query(
                        f"{_sum_rate('qosd_slo_samples_total', MET, 'class')}"
                        f" / {_sum_rate('qosd_slo_samples_total', CLASS, 'class')}",
                        "{{class}} reported",
                    ),
                    Query(
                        'max by (class) (qosd:slo_target:ratio{class=~"$class"})',
                        "{{class}} target",
                    ),
                ),
            ),
            Panel(
                "Error budget burn rate",
                "Misses relative to the error budget (1: the budget lasts the SLO period). "
                "The page fires above 14.4 on 1h and 5m, or 6 on 6h and 30m.",
                "short",
                tuple(
                    Query(
                        f"max by (class) (qosd:slo_burn_rate:rate{window}{{{CLASS}}})",
                        f"{{{{class}}}} {window}",
                    )
                    for window in ("5m", "1h", "6h")
                ),
            ),
            Panel(
                "Latency p99",
                "p99 of TTFT, TPOT and end to end in each class's window.",
                "s",
                (
                    Query(
                        f"max by (class, metric) (qosd_latency_seconds{{{P99}}})",
                        "{{class}} {{metric}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Admitted rate",
        (
            Panel(
                "Admitted rate R",
                "The pool's admitted rate as the SLO loop (or a pin) set it, against the "
                "configured capacity, and each class's share of it.",
                "short",
                (
                    Query(
                        f"max by (pool) (qosd_pool_rate_tokens_per_second{{{POOL}}})", "R {{pool}}"
                    ),
                    Query(
                        _max("qosd_pool_configured_capacity_tokens_per_second", POOL, "pool"),
                        "configured {{pool}}",
                    ),
                    Query(
                        f"max by (class) (qosd_class_rate_tokens_per_second{{{CLASS}}})",
                        "{{class}}",
                    ),
                ),
            ),
            Panel(
                "Rate adjustments",
                "Changes of the admitted rate over the interval: grow, cut, undo, pin, "
                "unpin, restore; and the daemons that lead the SLO loop (1 expected).",
                "short",
                (
                    Query(
                        f"sum by (pool, kind) (increase(qosd_rate_adjustments_total{{{POOL}}}{RATE}))",  # noqa: E501
                        "{{pool}} {{kind}}",
                    ),
                    Query("sum(qosd_controller_leader)", "leaders"),
                    Query(f"max by (pool) (qosd_pool_pinned{{{POOL}}})", "pinned {{pool}}"),
                ),
            ),
        ),
    ),
    (
        "In flight",
        (
            Panel(
                "Leases in flight against the bound",
                "Leases neither released nor expired, fleet-wide, and the pool's "
                "max_in_flight (absent without one).",
                "short",
                (
                    Query(f"max by (pool) (qosd_active_leases{{{POOL}}})", "in flight {{pool}}"),
                    Query(f"max by (pool) (qosd_pool_max_in_flight{{{POOL}}})", "bound {{pool}}"),
                ),
            ),
            Panel(
                "Tokens in flight against the bound",
                "Prompt plus expected output tokens of the leases in flight (the KV cache "
                "they hold), and the pool's max_in_flight_tokens.",
                "short",
                (
                    Query(f"max by (pool) (qosd_in_flight_tokens{{{POOL}}})", "in flight {{pool}}"),
                    Query(
                        f"max by (pool) (qosd_pool_max_in_flight_tokens{{{POOL}}})",
                        "bound {{pool}}",
                    ),
                ),
            ),
            Panel(
                "Prefill backlog",
                "The prefill admitted ahead and not yet done, predicted by the pool's "
                "prefill model (GPU-gated pools; 0 without a model).",
                "s",
                (Query(_max("qosd_prefill_backlog_seconds", POOL, "pool"), "{{pool}}"),),
            ),
            Panel(
                "Servers' backlog",
                "What the model servers report of themselves (ReportRequest.loads): "
                "requests they hold waiting, and their largest KV cache usage.",
                "short",
                (
                    Query(
                        f"max by (pool) (qosd_server_waiting_requests{{{POOL}}})",
                        "waiting {{pool}}",
                    ),
                    Query(
                        f"max by (pool) (qosd_server_kv_cache_usage{{{POOL}}})", "KV usage {{pool}}"
                    ),
                ),
            ),
        ),
    ),
    (
        "Store",
        (
            Panel(
                "Store call latency",
                "p99 of each store call as the daemons see it, the wait for a connection included.",
                "s",
                (Query(_quantile(0.99, "qosd_store_call_seconds", "", "call"), "{{call}} p99"),),
            ),
            Panel(
                "Store errors and resets",
                "Store calls that failed, per second; pools seen come back empty; and "
                "whether every daemon's last read of the store succeeded.",
                "short",
                (
                    Query(
                        f"sum by (call) (rate(qosd_store_errors_total{RATE}))", "errors {{call}}"
                    ),
                    Query(
                        f"sum by (pool) (increase(qosd_store_resets_total{{{POOL}}}{RATE}))",
                        "resets {{pool}}",
                    ),
                    Query("min(qosd_store_up)", "store up"),
                ),
            ),
        ),
    ),
    (
        "Operations",
        (
            Panel(
                "Config reloads",
                "Reloads applied and refused over the interval, and whether every "
                "daemon's last reload was applied.",
                "short",
                (
                    Query(f"sum(increase(qosd_config_reloads_total{RATE}))", "applied"),
                    Query(f"sum(increase(qosd_config_reload_failures_total{RATE}))", "refused"),
                    Query("min(qosd_config_last_reload_successful)", "last applied"),
                ),
            ),
            Panel(
                "Auth refusals",
                "Calls refused by authorization, by method and code.",
                "reqps",
                (
                    Query(
                        f"sum by (method, code) (rate(qosd_auth_refusals_total{RATE}))",
                        "{{method}} {{code}}",
                    ),
                ),
            ),
            Panel(
                "Fail-mode answers",
                "Acquires answered without the store: admitted unchecked (FAIL_OPEN) or "
                "refused (BACKEND_UNAVAILABLE).",
                "reqps",
                (
                    Query(
                        _decisions(
                            POOL + ', reason=~"FAIL_OPEN|BACKEND_UNAVAILABLE"', "pool, reason"
                        ),
                        "{{pool}} {{reason}}",
                    ),
                ),
            ),
        ),
    ),
)


def _panel(panel: Panel, width: int, panel_id: int) -> timeseries.Panel:
    built = (
        timeseries.Panel()
        .id(panel_id)
        .title(panel.title)
        .description(panel.description)
        .unit(panel.unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(width)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
    )
    for index, query in enumerate(panel.queries):
        built = built.with_target(
            prometheus.Dataquery()
            .expr(query.expr)
            .legend_format(query.legend)
            .ref_id(chr(ord("A") + index))
        )
    return built


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )


def build() -> gd.Dashboard:
    board = (
        gd.Dashboard("qosd")
        .uid(UID)
        .description("qosd admission control: decisions, waiting room, objectives, rates, store.")
        .tags(["qosd", "llm-inference"])
        .refresh("30s")
        .time("now-3h", "now")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            _variable("pool", "Pool", "label_values(qosd_pool_rate_tokens_per_second, pool)")
        )
        .with_variable(
            _variable(
                "class",
                "Class",
                'label_values(qosd_class_rate_tokens_per_second{pool=~"$pool"}, class)',
            )
        )
    )
    panel_id = 0
    for title, panels in ROWS:
        panel_id += 1
        board = board.with_row(gd.Row(title).id(panel_id))
        width = 24 // len(panels)
        for panel in panels:
            panel_id += 1
            board = board.with_panel(_panel(panel, width, panel_id))
    return board


def render() -> str:
    """The dashboard's JSON, as checked in."""
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: run scripts/gen_dashboard.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
