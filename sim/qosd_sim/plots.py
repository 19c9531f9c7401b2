"""PNG plots of replay runs: per-class latency over time, and rates over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
                f"{run.name}: {label} by arrival (dashed: SLO; bars: long prompts admitted)"
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
        ax.set_title(f"{run.name}: admitted cost by admission time; qosd's rate")
        ax.set_xlabel("s")
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(rates_path, dpi=90)
    plt.close(figure)
    return [latency_path, rates_path]


def plot_pareto(results: Mapping[str, Any], prefix: Path) -> Path:
    """One cell on the operator's plane: P0 on time (of offered) against the trace's
    goodput, every policy's mean with its seeds' range, static's sweep joined in
    capacity order, the achievable references and the bound as P0 levels."""
    import matplotlib  # noqa: PLC0415 - heavy; only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    path = prefix.with_name(prefix.name + "_pareto.png")
    figure, ax = plt.subplots(figsize=(7.5, 5.5))
    per_seed = results["per_seed"]
    sweep = sorted(
        (e for e in results["frontier"] if e["policy"] == "static"),
        key=lambda e: e["capacity_factor"] or 0.0,
    )
    if sweep:
        ax.plot([e["goodput"] for e in sweep], [e["P0"] for e in sweep], color="tab:blue",
                linewidth=1, alpha=0.6)  # fmt: skip
    for entry in results["frontier"]:
        if entry["P0"] is None or entry["goodput"] is None:
            continue
        name = entry["name"]
        seeds = [_point(s["policies"][name]) for s in per_seed if name in s["policies"]]
        xs = [x for x, y in seeds if x is not None and y is not None]
        ys = [y for x, y in seeds if x is not None and y is not None]
        color = POLICY_COLORS.get(entry["policy"], "black")
        ax.errorbar(
            entry["goodput"], entry["P0"],
            xerr=[[entry["goodput"] - min(xs, default=entry["goodput"])],
                  [max(xs, default=entry["goodput"]) - entry["goodput"]]],
            yerr=[[entry["P0"] - min(ys, default=entry["P0"])],
                  [max(ys, default=entry["P0"]) - entry["P0"]]],
            fmt="o" if entry["pareto_optimal"] else "s", color=color, alpha=0.85,
            markersize=8 if name == "qosd" else 5, capsize=2, elinewidth=0.7,
        )  # fmt: skip
        ax.annotate(name, (entry["goodput"], entry["P0"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    levels = [
        (results.get("bound", {}).get("scaled", {}).get("P0"), "P0 bound (proven)", "--"),
        (results.get("references", {}).get("P0_clairvoyant", {}).get("P0"),
         "P0 alone, the bound's set replayed", ":"),
        (results.get("references", {}).get("P0_online", {}).get("P0"),
         "P0 alone, online forward-run admission", "-."),
    ]  # fmt: skip
    for level, label, style in levels:
        if level is not None:
            ax.axhline(level, color="tab:red", linestyle=style, linewidth=1, label=label)
    ax.set_xlabel("trace goodput / the trace's FCFS-saturated throughput (mean; bars: seeds)")
    ax.set_ylabel("P0 on time, of offered (mean; bars: seeds)")
    shape = ", bursty" if results.get("bursty") else ""
    ax.set_title(
        f"{Path(str(results.get('trace', ''))).stem}{shape} {results.get('load')}x, "
        f"{results.get('engine')}: {len(per_seed)} seeds"
    )
    ax.set_ylim(0, 1.05)
    if any(level is not None for level, _, _ in levels):
        ax.legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


POLICY_COLORS = {
    "qosd": "tab:red",
    "static": "tab:blue",
    "vllm-native": "tab:green",
    "fifo-deadline": "tab:orange",
    "fifo": "tab:gray",
}


def _point(classes: Mapping[str, Any]) -> tuple[float | None, float | None]:
    return (
        classes["all"].get("trace_goodput_of_trace_saturated"),
        classes["P0"].get("attainment_of_offered"),
    )
