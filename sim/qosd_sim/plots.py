"""PNG plots of replay runs: per-class latency over time, and rates over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from qosd_sim.experiment import PolicyRun
from qosd_sim.objectives import Scoring
from qosd_sim.results import ClassFacts, admitted_cost_series

CLASSES = ("P0", "P1", "P2")
COLORS = {"P0": "tab:red", "P1": "tab:blue", "P2": "tab:gray"}


def plot_runs(
    runs: Sequence[PolicyRun],
    scoring: Scoring,
    facts: Mapping[str, ClassFacts],
    prefix: Path,
    output_weight: float = 4.0,
) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - heavy; only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    latency_path = prefix.with_name(prefix.name + "_latency.png")
    figure, axes = plt.subplots(len(runs), 2, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for row, run in enumerate(runs):
        for col, (metric, label) in enumerate((("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))):
            ax = axes[row][col]
            for name in CLASSES:
                points = [
                    (r.request.at_s, getattr(r, metric))
                    for r in run.records
                    if r.request.qos_class == name and r.completed and getattr(r, metric)
                ]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.scatter(xs, ys, s=4, alpha=0.5, color=COLORS[name], label=name)
                slo = getattr(scoring[name], metric)
                if slo:
                    ax.axhline(slo, color=COLORS[name], linestyle="--", linewidth=1)
            injected = [r.request.at_s for r in run.records if r.request.injected and r.admitted]
            for at in injected:
                ax.axvline(at, color="black", alpha=0.15, linewidth=2)
            ax.set_yscale("log")
            ax.set_title(
                f"{run.policy.value}: {label} by arrival (dashed: SLO; bars: long prompts admitted)"
            )
            ax.set_xlabel("arrival, s")
            ax.set_ylabel(f"{label}, ms")
            ax.legend(loc="upper left", markerscale=3, fontsize=8)
    figure.tight_layout()
    figure.savefig(latency_path, dpi=90)
    plt.close(figure)

    rates_path = prefix.with_name(prefix.name + "_rates.png")
    figure, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.6), squeeze=False)
    for col, run in enumerate(runs):
        ax = axes[0][col]
        bin_s = 4.0
        series = admitted_cost_series(run.records, facts, output_weight, bin_s=bin_s)
        bins = len(next(iter(series.values()), [0.0]))
        starts = [i * bin_s for i in range(bins)]
        stacked = [series.get(name, [0.0] * bins) for name in CLASSES]
        ax.stackplot(
            starts,
            stacked,
            colors=[COLORS[name] for name in CLASSES],
            alpha=0.6,
            labels=[f"{name} admitted" for name in CLASSES],
            step="post",
        )
        if run.rates:
            ax.step(
                [p.t_s for p in run.rates],
                [p.pool_rate for p in run.rates],
                color="black",
                where="post",
                label="pool rate R",
            )
        ax.set_ylabel(f"cost/s (input + {output_weight:g} x output tokens)")
        ax.set_title(f"{run.policy.value}: admitted cost by admission time; qosd's rate")
        ax.set_xlabel("s")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(rates_path, dpi=90)
    plt.close(figure)
    return [latency_path, rates_path]
