"""The bursty workloads' arrival statistics beside the targets they were fitted to.

    python benchmarks/burst_shape.py --json docs/results/burst_shape.json

For each load, it builds exactly the bursty workloads ``benchmarks/qos_replay.py
--bursty`` replays (the Azure conversation trace from each seed's start, at that
load, 120 s), and prints the process fitted to the targets (``BurstProcess.fit``, on
seeds 1000-1007) and the statistics of each seed's arrivals over 1-s bins: the share
of empty bins, the busiest bin over the mean, the inter-arrival CV, and the non-empty
bins' mean over the mean and their spread (CV), beside the targets. The seeds are the
reported ones (11, 12, 13) and the development ones (1, 2, 3).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from qosd_sim.gpu import GpuModel
from qosd_sim.replay import BurstTargets, arrival_shape, read_trace
from qosd_sim.seeds import DEVELOPMENT_SEEDS, REPORTED_SEEDS
from qosd_sim.workload import WorkloadSpec, seeded_workload

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"

FIGURES = ("empty_bin_share", "peak_to_mean_1s", "interarrival_cv", "nonempty_to_mean",
           "nonempty_cv")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--loads", default="1.5,2")
    parser.add_argument("--bursty", default="", metavar="EMPTY:PEAK:CV")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    targets = BurstTargets.parse(args.bursty)
    rows = read_trace(args.trace)
    gpu = GpuModel()
    out: dict[str, Any] = {"targets": targets.as_dict(), "loads": {}}
    print(
        f"targets: {targets.empty_bin_share:.0%} of 1-s bins empty, peak {targets.peak_to_mean:g}x "
        f"the mean, inter-arrival CV {targets.interarrival_cv:g} (non-empty bins then "
        f"{1 / (1 - targets.empty_bin_share):.1f}x the mean)\n"
    )
    print("| load | seeds | process | " + " | ".join(FIGURES) + " |")
    print("|---|---|---|" + "---:|" * len(FIGURES))
    for load in (float(x) for x in args.loads.split(",")):
        spec = WorkloadSpec(load=load, bursts=targets)  # qos_replay.py's defaults
        per_load: dict[str, Any] = {}
        for label, seeds in (("reported", REPORTED_SEEDS), ("development", DEVELOPMENT_SEEDS)):
            shapes = []
            processes = []
            for seed in seeds:
                built = seeded_workload(rows, gpu, spec, seed)
                trace = [r.at_s for r in built.requests if not r.injected]
                shapes.append(arrival_shape(trace, 120.0).as_dict())
                assert built.burst_process is not None
                processes.append(built.burst_process.as_dict())
            means = {f: round(statistics.fmean(float(s[f] or 0.0) for s in shapes), 3)
                     for f in FIGURES}  # fmt: skip
            per_load[label] = {
                "seeds": list(seeds),
                "processes": processes,
                "per_seed": shapes,
                "mean": means,
            }
            for seed, shape, p in zip(seeds, shapes, processes, strict=True):
                cells = " | ".join(f"{float(shape[f] or 0.0):.2f}" for f in FIGURES)
                process = (
                    f"{p['bursts_per_s']:.3f} bursts/s, exponent {p['size_exponent']}, "
                    f"spread {p['spread_s'] * 1000:.0f} ms"
                )
                print(f"| {load:g}x | {label} {seed} | {process} | {cells} |")
            cells = " | ".join(f"{means[f]:.2f}" for f in FIGURES)
            print(f"| {load:g}x | {label}, mean | | {cells} |")
        out["loads"][f"{load:g}"] = per_load
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
