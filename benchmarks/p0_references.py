"""P0's bound and achievable references for every cell of the matrix, in virtual time.

    python benchmarks/p0_references.py --json docs/results/p0_references.json

For each workload (the Azure trace, the Mooncake trace, the bursty shape), load
(1.5, 2.0), engine and seed (11 to 20), the same requests ``qos_replay.py`` would
replay (``--trace T --load L --engine E [--bursty]``), and of their P0 requests: the
proven upper bound on how many any policy gets on time (``qosd_sim.bound``), and two
schedules the engine itself runs with P0 alone (``qosd_sim.references``): admitting
only what a forward run predicts on time (``P0_online``), and replaying the bound's
own set (``P0_clairvoyant``). Beside them, the whole workload served first come
first served (every request, as with no admission at all: the most KV pressure any
policy puts on the server): the most KV the engine held, as a share of its cache, how
often a request that had a batch slot waited for KV room, and how often a running
request was preempted for KV. Where both are never, KV never bound the schedule.
No replay runs: the engine is run in virtual time, so the whole matrix takes about
an hour, where its replays take days on two CPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.qos_replay import HEADLINE, build_parser, gpu_model, workload_spec
from benchmarks.yardstick_matrix import WORKLOADS
from qosd_harness import source_commit
from qosd_sim.bound import on_time_bound
from qosd_sim.gpu import Engine, run_virtual
from qosd_sim.objectives import SCORINGS
from qosd_sim.references import p0_clairvoyant, p0_online
from qosd_sim.replay import read_trace
from qosd_sim.seeds import REPORTED_SEEDS
from qosd_sim.workload import seeded_workload


def cell(workload: str, load: float, engine: str, seeds: list[int]) -> dict[str, Any]:
    trace, bursty = WORKLOADS[workload]
    flags = ["--trace", str(trace), "--load", str(load), "--engine", engine, "--json", "-"]
    args = build_parser().parse_args(flags + (["--bursty"] if bursty else []))
    gpu, rows = gpu_model(args), read_trace(args.trace)
    objectives = SCORINGS[HEADLINE]["P0"]
    per_seed: list[dict[str, Any]] = []
    for seed in seeds:
        drawn = seeded_workload(rows, gpu, workload_spec(args), seed)
        p0 = [r for r in drawn.requests if r.qos_class == "P0"]
        bound = on_time_bound(gpu, [(r.at_s, r.input_tokens) for r in p0], objectives)
        fcfs = Engine(gpu)
        run_virtual(gpu, [(r.at_s, r.input_tokens, r.output_tokens) for r in drawn.requests],
                    engine=fcfs)  # fmt: skip
        per_seed.append(
            {
                "seed": seed,
                "kv_peak_share": round(fcfs.kv_peak / gpu.kv_capacity_tokens, 4),
                "kv_refusals": fcfs.kv_refusals,
                "kv_preemptions": fcfs.preemptions,
                "offered": len(p0),
                "bound": bound.share,
                "bound_exact": bound.exact,
                "P0_online": p0_online(gpu, p0, objectives).share,
                "P0_clairvoyant": p0_clairvoyant(gpu, p0, objectives, bound.chosen).share,
            }
        )
    summary: dict[str, Any] = {"workload": workload, "load": load, "engine": gpu.engine}
    summary["kv_peak_share_max"] = max(s["kv_peak_share"] for s in per_seed)
    summary["kv_refusals_total"] = sum(s["kv_refusals"] for s in per_seed)
    summary["kv_preemptions_total"] = sum(s["kv_preemptions"] for s in per_seed)
    for key in ("offered", "bound", "P0_online", "P0_clairvoyant"):
        values = [float(s[key]) for s in per_seed if s[key] is not None]
        summary[key] = round(statistics.fmean(values), 4) if values else None
        summary[f"{key}_min"] = min(values) if values else None
    summary["per_seed"] = per_seed
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default="1.5,2")
    parser.add_argument("--engines", default="chunked,unchunked,chunked-priority,chunked-512")
    parser.add_argument("--seeds", default=",".join(map(str, REPORTED_SEEDS)))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    commit = source_commit(Path(__file__).resolve().parents[1])
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = []
    print(
        "| workload | load | engine | P0 offered | bound | P0 alone: bound's set | online "
        "| FCFS: peak KV held | waits for KV | preemptions for KV |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for workload in args.workloads.split(","):
        for load in (float(x) for x in args.loads.split(",")):
            for engine in args.engines.split(","):
                began = time.monotonic()
                c = cell(workload, load, engine, seeds)
                cells.append(c)
                print(
                    f"| {workload} | {load:g}x | {c['engine']} | {c['offered']:.1f} "
                    f"| {c['bound']:.1%} | {c['P0_clairvoyant']:.1%} | {c['P0_online']:.1%} "
                    f"| {c['kv_peak_share_max']:.0%} | {c['kv_refusals_total']} "
                    f"| {c['kv_preemptions_total']} |"
                    f" <!-- {time.monotonic() - began:.0f}s -->",
                    flush=True,
                )
    if args.json:
        result = {"commit": commit, "command": " ".join(sys.argv), "seeds": seeds,
                  "cells": cells}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
