"""The seed's problem and qosd's fix, measured: one trace replayed under three policies.

    python benchmarks/qos_replay.py --trace ../shared/traces/azure2023_conv.csv \
        --load 1.5 --json docs/results/qos_replay_1.5x.json

Each policy replays the same requests at the same offsets, end to end over real
sockets: the gateway loop (Acquire, stream from a simulated Triton through
``tritonclient``, Release), a qosd daemon on its own Redis, and a simulated GPU with
unchunked prefill into which a 32K-token prompt arrives every ``--inject-every`` s.

- ``fifo``: no QoS, every request straight to the server;
- ``static``: qosd's buckets at the seed's fixed 60/35/5, no SLO loop;
- ``qosd``: buckets, waiting room and the SLO loop.

Prints a table per class, and writes a JSON file, a markdown table and two PNG plots
(latency over time, rates over time). Definitions: ``qosd/sim/results.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

from qosd.config import Config
from qosd.sim.experiment import (
    Policy,
    PolicyRun,
    RatePoint,
    calibrated_workload,
    configured_capacity,
    run_policy,
)
from qosd.sim.gateway import RequestRecord
from qosd.sim.gpu import GpuModel
from qosd.sim.plots import plot_runs
from qosd.sim.replay import ClassRule, Request, read_trace
from qosd.sim.results import Objectives, policy_summary
from qosd.testing import redis_server

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"
CLASSES = ("P0", "P1", "P2")


def print_table(results: dict[str, Any]) -> str:
    header = (
        "| policy | class | SLO attainment | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
        "goodput tok/s | admitted | rejected | timed out | unfinished | errors | "
        "worst wait ms |"
    )
    lines = [header, "|" + "---|" * 12]
    for policy, classes in results["policies"].items():
        for name in CLASSES:
            c = classes[name]
            attain = "n/a" if c["slo_attainment"] is None else f"{c['slo_attainment']:.1%}"
            lines.append(
                f"| {policy} | {name} | {attain} | {c['ttft_p50_ms']} / {c['ttft_p99_ms']} | "
                f"{c['tpot_p50_ms']} / {c['tpot_p99_ms']} | {c['goodput_tokens_s']:,.0f} | "
                f"{c['admitted']}/{c['offered']} | {c['rejected']} | {c['timed_out']} | "
                f"{c['unfinished']} | {c['errors']} | {c['worst_wait_ms']:,.0f} |"
            )
        total = classes["all"]
        lines.append(
            f"| {policy} | all | | | | {total['goodput_tokens_s']:,.0f} "
            f"({total['goodput_of_capacity']:.0%} of capacity) | "
            f"32K prompts {total['long_prompts_admitted']}/{total['long_prompts_offered']} "
            "| | | | | |"
        )
    return "\n".join(lines)


RECORD_FIELDS = ("decision", "admitted", "waited_ms", "ttft_ms", "e2e_ms", "completed",
                 "tokens_seen", "error")  # fmt: skip


def save_runs(path: Path, runs: list[PolicyRun]) -> None:
    """Every request's outcome and the rate samples, so that the summary, the tables and
    the plots can be recomputed (``--from-records``) without replaying again."""
    data = {
        run.policy.value: {
            "duration_s": run.duration_s,
            "adjustments": run.adjustments,
            "rates": [[p.t_s, p.pool_rate] for p in run.rates],
            "records": [
                [*dataclasses.astuple(r.request), *(getattr(r, f) for f in RECORD_FIELDS)]
                for r in run.records
            ],
        }
        for run in runs
    }
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump(data, handle)


def load_runs(path: Path) -> list[PolicyRun]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        data = json.load(handle)
    runs = []
    width = len(dataclasses.fields(Request))
    for policy, run in data.items():
        records = []
        for row in run["records"]:
            record = RequestRecord(Request(*row[:width]))
            for name, value in zip(RECORD_FIELDS, row[width:], strict=True):
                setattr(record, name, value)
            records.append(record)
        rates = [RatePoint(t, rate, {}, {}, {}) for t, rate in run["rates"]]
        runs.append(
            PolicyRun(Policy(policy), records, rates, run["duration_s"], run["adjustments"])
        )
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE) if DEFAULT_TRACE.exists() else None,
        help="arrival_s,input_tokens,output_tokens CSV (default: the Azure conversation "
        "trace, else the bundled sample)",
    )
    parser.add_argument("--load", type=float, default=1.5, help="offered load / GPU capacity")
    parser.add_argument(
        "--duration", type=float, default=40.0, help="seconds of arrivals per policy"
    )
    parser.add_argument(
        "--drain", type=float, default=15.0, help="seconds to let admitted work finish"
    )
    parser.add_argument(
        "--inject-every", type=float, default=10.0, help="a long prompt every N s (0: none)"
    )
    parser.add_argument("--inject-tokens", type=int, default=32_768)
    parser.add_argument("--inject-output", type=int, default=128)
    parser.add_argument("--mix", default="P0=0.2,P1=0.5,P2=0.3", help="class mix by request hash")
    parser.add_argument(
        "--long-prompt-tokens", type=int, default=16_384, help="prompts this long are P2"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--output-weight", type=float, default=4.0, help="qosd's cost.output_weight"
    )
    parser.add_argument(
        "--chunked",
        type=int,
        default=0,
        metavar="TOKENS",
        help="chunked prefill budget (0: unchunked)",
    )
    parser.add_argument(
        "--long-prompts",
        choices=["admit", "refuse"],
        default="admit",
        help="qosd policies: admit long prompts at P2's rate (P2 may go into debt), or "
        "refuse those costing more than P2's burst",
    )
    parser.add_argument(
        "--capacity",
        choices=["slo", "saturated"],
        default="slo",
        help="the pool's configured capacity: what the GPU serves within P0's SLO (an "
        "operator's load test), or its saturated throughput (an optimistic guess the SLO "
        "loop must correct)",
    )
    parser.add_argument("--policies", default="fifo,static,qosd")
    parser.add_argument(
        "--from-records",
        action="store_true",
        help="do not replay: recompute the summary, table and plots from the records "
        "file a previous run wrote beside --json",
    )
    parser.add_argument("--json", required=True, help="results file")
    parser.add_argument("--markdown", help="table file (default: beside --json)")
    parser.add_argument("--plots", help="PNG prefix (default: beside --json)")
    args = parser.parse_args()  # fmt: skip

    gpu = GpuModel(prefill_chunk_tokens=args.chunked or None)
    rule = ClassRule.parse(args.mix, long_prompt_tokens=args.long_prompt_tokens, seed=args.seed)
    workload, capacity, speedup = calibrated_workload(
        read_trace(args.trace),
        gpu,
        rule,
        load=args.load,
        duration_s=args.duration,
        inject_every_s=args.inject_every or None,
        inject_tokens=args.inject_tokens,
        inject_output_tokens=args.inject_output,
    )
    trace_requests = [r for r in workload if not r.injected]
    pool_capacity, slo_fraction = configured_capacity(gpu, workload, args.output_weight, Config())
    if args.capacity == "saturated":
        pool_capacity /= slo_fraction
    objectives = Objectives.from_config(Config())
    offered = sum(r.tokens() for r in trace_requests) / args.duration
    print(
        f"{len(workload)} requests in {args.duration:.0f}s (trace time / {speedup:.2f}); GPU "
        f"capacity on the trace's mix {capacity:,.0f} tokens/s, of which {slo_fraction:.0%} "
        f"within P0's SLO; the pool is configured at {pool_capacity:,.0f} cost units/s "
        f"({args.capacity}). "
        f"The trace offers {offered:,.0f} tokens/s = {offered / capacity:.2f}x capacity, "
        f"plus a {args.inject_tokens:,}-token prompt every {args.inject_every:g}s",
        flush=True,
    )

    records_path = Path(args.json).with_suffix(".records.json.gz")
    if args.from_records:
        loaded = load_runs(records_path)
        previous: dict[str, Any] = json.loads(Path(args.json).read_text())
        for run in loaded:
            previous["policies"][run.policy.value] = policy_summary(
                run.records, objectives, window_s=args.duration, capacity_tokens_s=capacity
            )
            if run.adjustments:
                previous["policies"][run.policy.value]["all"]["adjustments"] = run.adjustments
        return write_outputs(args, previous, loaded, objectives)

    runs: list[PolicyRun] = []
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "trace": args.trace or "bundled sample",
        "load": args.load,
        "offered_load": round(offered / capacity, 3),
        "duration_s": args.duration,
        "requests": len(workload),
        "time_compression": round(speedup, 3),
        "long_prompts": args.long_prompts,
        "inject_every_s": args.inject_every,
        "inject_tokens": args.inject_tokens,
        "output_weight": args.output_weight,
        "capacity_tokens_s": round(capacity, 1),
        "slo_load": round(slo_fraction, 3),
        "configured_capacity": args.capacity,
        "pool_capacity_cost_s": round(pool_capacity, 1),
        "gpu": {name: getattr(gpu, name) for name in gpu.__dataclass_fields__},
        "policies": {},
    }
    with redis_server() as redis:
        for name in args.policies.split(","):
            policy = Policy(name.strip())
            began = time.monotonic()
            run = run_policy(
                policy,
                workload,
                gpu=gpu,
                capacity_cost_s=pool_capacity,
                output_weight=args.output_weight,
                redis_url=redis.url,
                drain_s=args.drain,
                admit_long_prompts=args.long_prompts == "admit",
            )
            runs.append(run)
            results["policies"][policy.value] = policy_summary(
                run.records, objectives, window_s=args.duration, capacity_tokens_s=capacity
            )
            if run.adjustments:
                results["policies"][policy.value]["all"]["adjustments"] = run.adjustments
            print(f"{policy.value}: ran in {time.monotonic() - began:.0f}s", flush=True)
    save_runs(records_path, runs)
    return write_outputs(args, results, runs, objectives)


def write_outputs(
    args: argparse.Namespace,
    results: dict[str, Any],
    runs: list[PolicyRun],
    objectives: dict[str, Objectives],
) -> int:
    table = print_table(results)
    print(table)
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    markdown = Path(args.markdown) if args.markdown else json_path.with_suffix(".md")
    markdown.write_text(table + "\n")
    prefix = Path(args.plots) if args.plots else json_path.with_suffix("")
    for path in plot_runs(runs, objectives, prefix, args.output_weight):
        print(f"wrote {path}")
    print(f"wrote {json_path} and {markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
