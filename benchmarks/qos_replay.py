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

Any ``arrival_s,input_tokens,output_tokens`` trace replays: smooth, bursty, or
long-context (prompts to 200K tokens), and ``--bursty`` makes any of them bursty. Classes
come from a seeded hash (P0 20 %, P1 50 %, P2 30 %), the injected prompts are P1. The
pool's capacity is the GPU's SLO capacity (``--capacity slo``, a figure reported, with a
stated fallback when unreachable), its saturated throughput, or half the SLO capacity.

Prints a table per policy and class and one per policy, and writes a JSON file, the
markdown tables, the per-request records and two PNG plots (latency over time, rates
over time). Every field: ``docs/simulator.md``; definitions: ``sim/qosd_sim/results.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from qosd.config import Config
from qosd_sim.ceiling import class_ceiling
from qosd_sim.experiment import (
    MODEL,
    CapacityChoice,
    Policy,
    PolicyRun,
    RatePoint,
    calibrated_workload,
    configured_capacity,
    run_policy,
)
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.harness import redis_server
from qosd_sim.plots import plot_runs
from qosd_sim.replay import (
    Bursts,
    ClassRule,
    Request,
    arrival_shape,
    bursty_workload,
    read_trace,
)
from qosd_sim.results import Objectives, policy_summary, timeline

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"
CLASSES = ("P0", "P1", "P2")


def _pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_table(results: dict[str, Any]) -> str:
    """Two markdown tables: per policy and class, then per policy."""
    header = (
        "| policy | class | attained / offered | attained / admitted | TTFT p99 ms | "
        "TPOT p99 ms | admitted / offered | rejected | timed out | unfinished | "
        "worst wait ms | served token share |"
    )
    lines = [header, "|" + "---|" * 2 + "---:|" * 10]
    for policy, classes in results["policies"].items():
        for name in CLASSES:
            c = classes[name]
            lines.append(
                f"| {policy} | {name} | {_pct(c['attainment_of_offered'])} | "
                f"{_pct(c['slo_attainment'])} | {_num(c['ttft_p99_ms'])} | "
                f"{_num(c['tpot_p99_ms'])} | {c['admitted']}/{c['offered']} | "
                f"{c['rejected']} | {c['timed_out']} | {c['unfinished']} | "
                f"{c['worst_wait_ms']:,.0f} | {_pct(c['served_token_share'])} |"
            )
    lines += [
        "",
        "| policy | attained / offered | goodput / saturated | busy fraction | "
        "goodput tok/s (window) | admitted cost / R | long prompts admitted | "
        "qosd unavailable | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, classes in results["policies"].items():
        total = classes["all"]
        errors = sum(classes[name]["errors"] for name in CLASSES)
        unavailable = sum(classes[name].get("unavailable", 0) for name in CLASSES)
        lines.append(
            f"| {policy} | {_pct(total['attainment_of_offered'])} | "
            f"{_pct(total['goodput_of_saturated'])} | {_pct(total['busy_fraction'])} | "
            f"{total['goodput_window_tokens_s']:,.0f} | "
            f"{_pct(total.get('admitted_cost_of_pool_rate'), 0)} | "
            f"{total['long_prompts_admitted']}/{total['long_prompts_offered']} | "
            f"{unavailable} | {errors} |"
        )
    return "\n".join(lines)


RECORD_FIELDS = ("decision", "admitted", "waited_ms", "ttft_ms", "e2e_ms", "completed",
                 "tokens_seen", "error")  # fmt: skip


def save_runs(path: Path, runs: list[PolicyRun]) -> None:
    """Every request's outcome, the rate samples and the GPU's busy samples, so that
    the summary, the tables and the plots can be recomputed (``--from-records``)
    without replaying again."""
    data = {
        run.policy.value: {
            "duration_s": run.duration_s,
            "adjustments": run.adjustments,
            "rates": [[p.t_s, p.pool_rate] for p in run.rates],
            "busy": [list(sample) for sample in run.busy],
            "records": [
                [*dataclasses.astuple(r.request), *(getattr(r, f) for f in RECORD_FIELDS)]
                for r in run.records
            ],
        }
        for run in runs
    }
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        json.dump(data, handle)


def config_settings(settings: list[str]) -> Callable[[dict[str, Any]], None]:
    """``--set`` as a config-tree override: ``a.b.c=VALUE`` sets ``tree[a][b][c]`` to
    VALUE read as YAML, ``pool.`` standing for the simulated model's pool. A path that
    names no existing setting's parent is refused at once, before any run."""
    parsed: list[tuple[list[str], Any]] = []
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {setting!r}: expected KEY=VALUE")
        path = key.split(".")
        if path[0] == "pool":
            path = ["pools", MODEL, *path[1:]]
        parsed.append((path, yaml.safe_load(value)))

    def apply(tree: dict[str, Any]) -> None:
        for path, value in parsed:
            node = tree
            for part in path[:-1]:
                if not isinstance(node.get(part), dict):
                    raise SystemExit(f"--set {'.'.join(path)}: no setting {part!r} there")
                node = node[part]
            node[path[-1]] = value

    return apply


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
        busy = [(t, b) for t, b in run.get("busy", [])]  # absent in older files
        runs.append(
            PolicyRun(Policy(policy), records, rates, run["duration_s"], run["adjustments"], busy)
        )
    return runs


def summarize(
    run: PolicyRun,
    objectives: dict[str, Objectives],
    *,
    window_s: float,
    capacity: float,
    output_weight: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy's summary, and its per-second timeline."""
    rates = [(p.t_s, p.pool_rate) for p in run.rates]
    summary = policy_summary(
        run.records,
        objectives,
        window_s=window_s,
        capacity_tokens_s=capacity,
        busy=run.busy,
        rates=rates,
        output_weight=output_weight,
    )
    if run.adjustments:
        summary["all"]["adjustments"] = run.adjustments
    series = timeline(
        run.records,
        objectives,
        output_weight=output_weight,
        rates=rates,
        busy=run.busy,
        end_s=max(run.duration_s, window_s),
    )
    return summary, series


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
        "--drain", type=float, default=30.0, help="seconds to let admitted work finish"
    )
    parser.add_argument(
        "--inject-every", type=float, default=10.0, help="a long prompt every N s (0: none)"
    )
    parser.add_argument("--inject-tokens", type=int, default=32_768)
    parser.add_argument("--inject-output", type=int, default=128)
    parser.add_argument(
        "--inject-class",
        default="P1",
        help="class of the injected long prompts (default P1: an ordinary user's prompt)",
    )
    parser.add_argument("--mix", default="P0=0.2,P1=0.5,P2=0.3", help="class mix by request hash")
    parser.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=0,
        help="opt-in: trace prompts this long are P2 (0, the default: classes by the "
        "hash mix whatever the length)",
    )
    parser.add_argument(
        "--bursty",
        nargs="?",
        const="",
        default=None,
        metavar="DUTY:PEAK[:PERIOD_S]",
        help="move the trace's arrivals into bursts, seeded by --seed: on-periods of "
        "DUTY x each PERIOD_S-second cycle, whose first second arrives at PEAK x the "
        f"mean rate; the load is unchanged (default {Bursts().duty:g}:{Bursts().peak:g}:"
        f"{Bursts().period_s:g})",
    )
    parser.add_argument("--seed", type=int, default=7, help="seeds the class hash and --bursty")
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
        help="qosd policies: admit any request of the workload at its class's rate (a "
        "class may go into debt for one request up to the workload's largest), or refuse "
        "those costing more than 20,000",
    )
    parser.add_argument(
        "--capacity",
        choices=[c.value for c in CapacityChoice],
        default="slo",
        help="the pool's configured capacity: what the GPU serves within P0's SLO (an "
        "operator's load test; the knee when no load meets it), its saturated "
        "throughput (an optimistic guess the SLO loop must cut), or half the SLO "
        "capacity (too low: the loop must raise it)",
    )
    parser.add_argument("--policies", default="fifo,static,qosd")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a qosd policy's config setting, as a dotted path (pool.X: the simulated "
        "model's pool), its value as YAML, e.g. pool.max_prefill_share=0.25; repeatable",
    )
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
    rule = ClassRule.parse(
        args.mix, long_prompt_tokens=args.long_prompt_tokens or None, seed=args.seed
    )
    bursts = None if args.bursty is None else Bursts.parse(args.bursty)
    rows = read_trace(args.trace)
    too_long = [r for r in rows if r.input_tokens + r.output_tokens > gpu.kv_capacity_tokens]
    if too_long:
        print(
            f"{len(too_long)} trace requests exceed the GPU's KV cache "
            f"({gpu.kv_capacity_tokens:,} tokens): the simulated server will refuse them",
            file=sys.stderr,
        )
    workload, capacity, speedup = calibrated_workload(
        rows,
        gpu,
        rule,
        load=args.load,
        duration_s=args.duration,
        inject_every_s=args.inject_every or None,
        inject_tokens=args.inject_tokens,
        inject_output_tokens=args.inject_output,
        inject_class=args.inject_class,
    )
    # The pool's capacity comes from a load test on the trace's own arrivals; the
    # bursts are what admission control must then absorb.
    pool = configured_capacity(
        gpu,
        workload,
        args.output_weight,
        Config(),
        choice=CapacityChoice(args.capacity),
        window_s=args.duration,
    )
    if bursts is not None:
        workload = bursty_workload(workload, args.duration, bursts, args.seed)
    trace_requests = [r for r in workload if not r.injected]
    objectives = Objectives.from_config(Config())
    offered = sum(r.tokens() for r in trace_requests) / args.duration
    shape = arrival_shape([r.at_s for r in trace_requests], args.duration)
    slo = pool.slo
    slo_text = (
        f"{slo.load:.0%} of it within P0's SLO"
        if slo.load is not None
        else f"no load within P0's SLO (at 0.1 of it, {slo.floor_attainment:.0%} of requests)"
    )
    print(
        f"{len(workload)} requests in {args.duration:.0f}s (trace time / {speedup:.2f}); GPU "
        f"saturated capacity on the trace's mix {capacity:,.0f} tokens/s, {slo_text}; the "
        f"pool is configured at {pool.cost_s:,.0f} cost units/s ({args.capacity}: "
        f"{pool.rule}). The trace offers {offered:,.0f} tokens/s = {offered / capacity:.2f}x "
        f"capacity"
        + (
            f", plus a {args.inject_tokens:,}-token {args.inject_class} prompt every "
            f"{args.inject_every:g}s"
            if args.inject_every
            else ""
        )
        + f". Arrivals{' (bursty)' if bursts else ''}: {shape.empty_bin_share:.0%} of 1-s "
        f"bins empty, peak {shape.peak_to_mean:.1f}x the mean rate, inter-arrival CV "
        + ("n/a" if shape.interarrival_cv is None else f"{shape.interarrival_cv:.1f}"),
        flush=True,
    )

    # What any policy could serve of each class with objectives, given the GPU to it
    # alone (sim/qosd_sim/ceiling.py): the bar the goals are measured against.
    ceilings = {
        name: class_ceiling(
            gpu, [r for r in workload if r.qos_class == name], objectives[name]
        ).as_dict()
        for name in CLASSES
        if objectives[name].has_slo
    }
    for name, ceiling in ceilings.items():
        print(
            f"{name} given the GPU alone: {ceiling['alone_attainment']:.1%} on time served "
            f"in arrival order, {ceiling['shed_attainment']:.1%} with perfect-foresight "
            "shedding",
            flush=True,
        )

    records_path = Path(args.json).with_suffix(".records.json.gz")
    if args.from_records:
        loaded = load_runs(records_path)
        previous: dict[str, Any] = json.loads(Path(args.json).read_text())
        previous.setdefault("timelines", {})
        previous["class_ceilings"] = ceilings
        for run in loaded:
            summary, series = summarize(
                run,
                objectives,
                window_s=args.duration,
                capacity=capacity,
                output_weight=args.output_weight,
            )
            previous["policies"][run.policy.value] = summary
            previous["timelines"][run.policy.value] = series
        return write_outputs(args, previous, loaded, objectives)

    runs: list[PolicyRun] = []
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "trace": args.trace or "bundled sample",
        "load": args.load,
        "offered_load": round(offered / capacity, 3),
        "duration_s": args.duration,
        "drain_s": args.drain,
        "requests": len(workload),
        "time_compression": round(speedup, 3),
        "seed": args.seed,
        "class_mix": args.mix,
        "long_prompt_tokens": args.long_prompt_tokens or None,
        "bursty": None if bursts is None else bursts.as_dict(),
        "workload_shape": shape.as_dict(),
        "long_prompts": args.long_prompts,
        "inject_every_s": args.inject_every,
        "inject_tokens": args.inject_tokens,
        "inject_class": args.inject_class,
        "output_weight": args.output_weight,
        "qosd_settings": args.settings,
        "saturated_capacity_tokens_s": round(capacity, 1),
        "capacity_tokens_s": round(capacity, 1),
        **slo.as_dict(),
        "slo_load_measured_on": "the trace's own arrivals"
        + (", before --bursty" if bursts else ""),
        "configured_capacity": args.capacity,
        "pool_capacity_rule": pool.rule,
        "saturated_capacity_cost_s": round(pool.saturated_cost_s, 1),
        "pool_capacity_cost_s": round(pool.cost_s, 1),
        "gpu": {name: getattr(gpu, name) for name in gpu.__dataclass_fields__},
        "class_ceilings": ceilings,
        "policies": {},
        "timelines": {},
    }
    settings = config_settings(args.settings)
    with redis_server() as redis:
        for name in args.policies.split(","):
            policy = Policy(name.strip())
            began = time.monotonic()
            run = run_policy(
                policy,
                workload,
                gpu=gpu,
                capacity_cost_s=pool.cost_s,
                output_weight=args.output_weight,
                redis_url=redis.url,
                drain_s=args.drain,
                window_s=args.duration,
                admit_long_prompts=args.long_prompts == "admit",
                config_overrides=settings if policy is Policy.QOSD else None,
            )
            runs.append(run)
            summary, series = summarize(
                run,
                objectives,
                window_s=args.duration,
                capacity=capacity,
                output_weight=args.output_weight,
            )
            results["policies"][policy.value] = summary
            results["timelines"][policy.value] = series
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
