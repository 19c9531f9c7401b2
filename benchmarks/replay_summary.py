"""One table from several QoS replay results, against the QoS goals.

    python benchmarks/replay_summary.py docs/results/replay_*.json --markdown \
        docs/results/replay_summary.md

Each results file is one ``benchmarks/qos_replay.py`` run (its policies side by side).
Per run and policy it prints what the goals are judged on (definitions in
docs/simulator.md):

- P0 on time: ``attainment_of_offered`` of P0 (refused and timed-out requests count as
  misses); goal 99 %; beside it, P0's ceiling on the workload: the share on time that
  P0 could get with the GPU to itself, served in arrival order or with
  perfect-foresight shedding, whichever is higher (``class_ceilings``);
- P1: ``slo_attainment`` (of admitted; goal 95 %) and its served token share against
  its floor share;
- P2: ``attainment_of_offered`` (served) and ``waits_past_max`` (goal 0);
- goodput: ``all.goodput_of_saturated``; goal 0.8.

It writes the table as markdown, and the same figures as JSON beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HEADER = (
    "| workload | load | capacity | policy | P0 on time | P0 ceiling | P1 met (admitted) "
    "| P1 share / floor | P2 served | P2 past max wait | goodput / saturated "
    "| long prompts admitted |"
)


def _workload(results: dict[str, Any]) -> str:
    name = Path(results["trace"]).stem.split("_")[0]
    return f"{name}, bursty" if results.get("bursty") else name


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def rows(path: Path) -> list[dict[str, Any]]:
    results = json.loads(path.read_text())
    ceiling = results.get("class_ceilings", {}).get("P0", {}).get("ceiling")
    out = []
    for policy, classes in results["policies"].items():
        p0, p1, p2, every = classes["P0"], classes["P1"], classes["P2"], classes["all"]
        out.append(
            {
                "file": path.name,
                "workload": _workload(results),
                "load": results["load"],
                "capacity": results.get("configured_capacity", "slo"),
                "policy": policy,
                "p0_on_time": p0["attainment_of_offered"],
                "p0_ceiling": ceiling,
                "p1_met_admitted": p1["slo_attainment"],
                "p1_share": p1["served_token_share"],
                "p1_floor_share": p1["floor_share"],
                "p2_served": p2["attainment_of_offered"],
                "p2_past_max_wait": p2["waits_past_max"],
                "goodput_of_saturated": every["goodput_of_saturated"],
                "long_prompts": f"{every['long_prompts_admitted']}/{every['long_prompts_offered']}",
            }
        )
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = [HEADER, "|" + "---|" * 12]
    for r in table:
        lines.append(
            f"| {r['workload']} | {r['load']:g}x | {r['capacity']} | {r['policy']} "
            f"| {_percent(r['p0_on_time'])} | {_percent(r['p0_ceiling'])} "
            f"| {_percent(r['p1_met_admitted'])} "
            f"| {_percent(r['p1_share'])} / {_percent(r['p1_floor_share'])} "
            f"| {_percent(r['p2_served'])} | {r['p2_past_max_wait']} "
            f"| {r['goodput_of_saturated']:.2f} | {r['long_prompts']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", help="qos_replay.py JSON files")
    parser.add_argument("--markdown", help="write the table here (and JSON beside it)")
    args = parser.parse_args()
    table = [row for path in args.results for row in rows(Path(path))]
    text = markdown(table)
    print(text)
    if args.markdown:
        target = Path(args.markdown)
        target.write_text(text + "\n")
        target.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
