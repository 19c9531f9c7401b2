"""One table from several QoS replay results: the matrix.

    python benchmarks/replay_summary.py docs/results/replay_*.json --markdown \
        docs/results/replay_summary.md

Each results file is one ``benchmarks/qos_replay.py`` cell (its policies side by
side, several seeds). Per cell and policy it prints the mean over the seeds, and the
worst seed where a goal is judged on it (definitions in docs/simulator.md):

- P0 on time: ``attainment_of_offered`` (refused and timed-out requests are misses),
  its worst seed, ``bound.P0`` (the proven upper bound; its worst seed) and P0 as a
  fraction of it; and P0 under the fixed-500 ms scoring;
- P1: attainment of offered, and of admitted;
- P2: served, and waits past its max wait (the worst seed's);
- goodput over the span against the GPU's saturated capacity, injected prompts
  counted (its worst seed), and the trace's requests alone;
- the injected 32K prompts admitted.

It writes the table as markdown, and the same figures as JSON beside it.

``--headline`` prints, per cell of issue 37's yardstick, what the README shows: qosd's
P0 and trace goodput, the best baseline at qosd's P0 (``headline``) with the paired
bootstrap intervals of qosd minus it, and P0's references and bound.

``--cells`` prints each cell's own table, every policy with its worst seed, its
distance to the online reference and its interval against qosd, as
docs/yardstick.md shows them.

``--against OLD.json`` compares one cell run twice instead (say, before and after a
change that should not move the figures): for each policy in both, seed by seed, P0
and P1 on time and goodput, the change, and the spread between the seeds of the old
run, which a change within it cannot be told from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HEADER = (
    "| workload | load | engine | policy | P0 on time (worst) | bound.P0 (worst) | P0 / bound "
    "| P0, fixed 500 ms | P1 of offered / of admitted | P2 served / past max wait "
    "| goodput / saturated (worst) | trace only | 32K admitted |"
)


def _workload(results: dict[str, Any]) -> str:
    name = Path(results["trace"]).stem.split("_")[0]
    return f"{name}, bursty" if results.get("bursty") else name


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def rows(path: Path) -> list[dict[str, Any]]:
    results = json.loads(path.read_text())
    bound = results["bound"]["scaled"]
    out = []
    for policy, classes in results["policies"].items():
        worst = results["worst"][policy]
        p0, p1, p2, every = classes["P0"], classes["P1"], classes["P2"], classes["all"]
        out.append(
            {
                "file": path.name,
                "workload": _workload(results),
                "load": results["load"],
                "engine": results["engine"],
                "capacity": results["configured_capacity"],
                "seeds": results["seeds"],
                "policy": policy,
                "p0_on_time": p0["attainment_of_offered"],
                "p0_on_time_worst": worst["P0"]["attainment_of_offered"],
                "bound_p0": bound["P0"],
                "bound_p0_worst": bound["P0_worst"],
                "p0_fraction_of_bound": p0["fraction_of_bound"],
                "p0_fixed_500ms": results["fixed_p0"]["policies"][policy]["P0"][
                    "attainment_of_offered"
                ],
                "p1_of_offered": p1["attainment_of_offered"],
                "p1_of_admitted": p1["slo_attainment"],
                "p2_served": p2["attainment_of_offered"],
                "p2_past_max_wait_worst": worst["P2"].get("waits_past_max"),
                "goodput_span_of_saturated": every["goodput_span_of_saturated"],
                "goodput_span_of_saturated_worst": worst["all"]["goodput_span_of_saturated"],
                "trace_goodput_span_of_saturated": every["trace_goodput_span_of_saturated"],
                "long_prompts": f"{every['long_prompts_admitted']:.1f}/"
                f"{every['long_prompts_offered']:.0f}",
            }
        )
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = [HEADER, "|" + "---|" * 4 + "---:|" * 9]
    for r in table:
        lines.append(
            f"| {r['workload']} | {r['load']:g}x | {r['engine']} | {r['policy']} "
            f"| {_pct(r['p0_on_time'])} ({_pct(r['p0_on_time_worst'])}) "
            f"| {_pct(r['bound_p0'])} ({_pct(r['bound_p0_worst'])}) "
            f"| {_pct(r['p0_fraction_of_bound'])} | {_pct(r['p0_fixed_500ms'])} "
            f"| {_pct(r['p1_of_offered'])} / {_pct(r['p1_of_admitted'])} "
            f"| {_pct(r['p2_served'])} / {r['p2_past_max_wait_worst']} "
            f"| {r['goodput_span_of_saturated']:.3f} "
            f"({r['goodput_span_of_saturated_worst']:.3f}) "
            f"| {r['trace_goodput_span_of_saturated']:.3f} | {r['long_prompts']} |"
        )
    return "\n".join(lines)


COMPACT_HEADER = (
    "| workload | load | engine | P0 on time: FIFO / static / qosd (bound.P0) "
    "| P1 of offered: FIFO / static / qosd | goodput / saturated over the span: "
    "FIFO / static / qosd |"
)


def _join(rows_: list[dict[str, Any]], key: str, *, percent: bool = True) -> str:
    return " / ".join(_pct(r[key]).replace("%", "") if percent else f"{r[key]:.2f}" for r in rows_)


def compact(table: list[dict[str, Any]]) -> str:
    """One row per cell, the policies side by side (the README's table)."""
    cells: dict[tuple[str, float, str], dict[str, dict[str, Any]]] = {}
    for r in table:
        cells.setdefault((r["workload"], r["load"], r["engine"]), {})[r["policy"]] = r
    lines = [COMPACT_HEADER, "|---|---|---|---:|---:|---:|"]
    for (workload, load, engine), by in cells.items():
        order = [by[p] for p in ("fifo", "static", "qosd") if p in by]
        lines.append(
            f"| {workload} | {load:g}x | {engine} | {_join(order, 'p0_on_time')} % "
            f"({_pct(order[0]['bound_p0'])}) | {_join(order, 'p1_of_offered')} % "
            f"| {_join(order, 'goodput_span_of_saturated', percent=False)} |"
        )
    return "\n".join(lines)


HEADLINE_HEADER = (
    "| workload | load | engine | seeds | qosd: P0 / trace goodput | best baseline at qosd's "
    "P0: P0 / goodput | qosd minus it: P0 [95 %] | goodput [95 %] | P0 alone: online / "
    "bound's set / bound |"
)


def _span(figure: dict[str, Any] | None) -> str:
    if not figure or figure.get("mean") is None:
        return "n/a"
    return f"{figure['mean']:+.3f} [{figure['low']:+.3f}, {figure['high']:+.3f}]"


def headline(paths: list[Path]) -> str:
    """One row per cell: the README's table of the new yardstick."""
    lines = [HEADLINE_HEADER, "|---|---|---|---:|---:|---|---:|---:|---:|"]
    for path in paths:
        results = json.loads(path.read_text())
        head = results.get("headline")
        if not head:
            continue
        refs = results.get("references", {})
        interval = head.get("interval") or {}
        lines.append(
            f"| {_workload(results)} | {results['load']:g}x | {results['engine']} "
            f"| {len(results['seeds'])} | {_pct(head['qosd']['P0'])} / "
            f"{head['qosd']['goodput']:.3f} | {head['baseline']}: "
            f"{_pct(head['baseline_P0'])} / {head['baseline_goodput']:.3f} "
            f"| {_span(interval.get('P0'))} | {_span(interval.get('goodput'))} "
            f"| {_pct(refs.get('P0_online', {}).get('P0'))} / "
            f"{_pct(refs.get('P0_clairvoyant', {}).get('P0'))} / "
            f"{_pct(results['bound']['scaled']['P0'])} |"
        )
    return "\n".join(lines)


CELL_HEADER = (
    "| policy | P0 on time (worst) | P0 / online reference | trace goodput (worst) "
    "| P1 of offered | on the frontier | qosd minus it: P0 [95 %] | goodput [95 %] |"
)


def _cell_name(results: dict[str, Any]) -> str:
    workload = "bursty" if results.get("bursty") else Path(results["trace"]).stem.split("_")[0]
    return f"{workload.removesuffix('2023')} {results['load']:g}x {results['engine']}"


def cell_table(path: Path) -> str:
    """One cell of the yardstick, every policy: mean of the seeds (worst seed in
    brackets), P0 against the online reference, whether the point is on the frontier,
    and qosd minus it with its paired bootstrap interval; then P0's references."""
    results = json.loads(path.read_text())
    online = results["references"]["P0_online"]["P0"]
    points = {point["name"]: point for point in results["frontier"]}
    stem = path.name.removesuffix(".json")
    lines = [
        f"**{_cell_name(results)}** ([JSON](results/{path.name}), "
        f"[figure](results/{stem}_pareto.png)):",
        "",
        CELL_HEADER,
        "|---|---:|---:|---:|---:|:---:|---:|---:|",
    ]
    for policy, classes in results["policies"].items():
        worst, point = results["worst"][policy], points[policy]
        interval = results["intervals"].get(policy, {})
        share = classes["P0"].get("fraction_of_online")  # the mean of the seeds' ratios
        share_text = "n/a" if share is None else f"{share:.2f}"
        lines.append(
            f"| {policy} | {point['P0']:.1%} ({worst['P0']['attainment_of_offered']:.1%}) "
            f"| {share_text} | {point['goodput']:.3f} "
            f"({worst['all']['trace_goodput_of_trace_saturated']:.3f}) "
            f"| {classes['P1']['attainment_of_offered']:.1%} "
            f"| {'yes' if point['pareto_optimal'] else ''} "
            f"| {_span(interval.get('P0')) if interval else ''} "
            f"| {_span(interval.get('goodput')) if interval else ''} |"
        )
    refs = results["references"]
    lines += [
        "",
        f"P0 alone: online reference {_pct(online)}, the bound's set replayed "
        f"{_pct(refs['P0_clairvoyant']['P0'])}, proven bound "
        f"{_pct(results['bound']['scaled']['P0'])}.",
    ]
    return "\n".join(lines).replace("%", " %").replace("  %", " %")


SEED_FIGURES = (
    ("P0 on time", "P0", "attainment_of_offered"),
    ("P1 of offered", "P1", "attainment_of_offered"),
    ("goodput / saturated", "all", "goodput_span_of_saturated"),
)


def against(new_path: Path, old_path: Path) -> str:
    """Seed by seed, the same cell's figures in two runs, and the old run's spread."""
    new, old = json.loads(new_path.read_text()), json.loads(old_path.read_text())
    old_seeds = {run["seed"]: run for run in old["per_seed"]}
    lines = [
        f"{new_path.name} against {old_path.name}",
        "| policy | figure | seed: new / old | mean: new / old (change) | spread of old seeds |",
        "|---|---|---|---|---:|",
    ]
    for policy in new["policies"]:
        if policy not in old["policies"]:
            continue
        for label, cls, key in SEED_FIGURES:
            pairs = [
                (run["seed"], run["policies"][policy][cls][key],
                 old_seeds[run["seed"]]["policies"][policy][cls][key])
                for run in new["per_seed"] if run["seed"] in old_seeds
            ]  # fmt: skip
            if not pairs:
                continue
            old_values = [o for _, _, o in pairs]
            mean_new = sum(n for _, n, _ in pairs) / len(pairs)
            mean_old = sum(old_values) / len(pairs)
            seeds = ", ".join(f"{seed}: {n:.3f} / {o:.3f}" for seed, n, o in pairs)
            lines.append(
                f"| {policy} | {label} | {seeds} | {mean_new:.3f} / {mean_old:.3f} "
                f"({mean_new - mean_old:+.3f}) | {max(old_values) - min(old_values):.3f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", help="qos_replay.py JSON files")
    parser.add_argument("--markdown", help="write the table here (and JSON beside it)")
    parser.add_argument(
        "--compact", action="store_true", help="one row per cell, the policies side by side"
    )
    parser.add_argument(
        "--headline", action="store_true", help="qosd beside the best baseline at its P0"
    )
    parser.add_argument("--against", help="compare the one results file with this older one")
    parser.add_argument(
        "--cells", action="store_true", help="each cell's every policy, as docs/yardstick.md"
    )
    args = parser.parse_args()
    if args.cells:
        print("\n\n".join(cell_table(Path(path)) for path in args.results))
        return 0
    if args.headline:
        text = headline([Path(path) for path in args.results])
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        return 0
    if args.against:
        if len(args.results) != 1:
            parser.error("--against compares one results file with one other")
        print(against(Path(args.results[0]), Path(args.against)))
        return 0
    table = [row for path in args.results for row in rows(Path(path))]
    text = compact(table) if args.compact else markdown(table)
    print(text)
    if args.markdown:
        target = Path(args.markdown)
        target.write_text(text + "\n")
        target.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
