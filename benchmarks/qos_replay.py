"""The seed's problem and qosd's fix, measured: one trace replayed under three policies.

    python benchmarks/qos_replay.py --trace ../shared/traces/azure2023_conv.csv \
        --load 1.5 --engine chunked --json docs/results/replay_azure_1.5x_chunked.json

Each policy replays the same requests at the same offsets, end to end over real
sockets: the gateway loop (Acquire, stream from a simulated Triton through
``tritonclient``, Release), a qosd daemon on its own keys in a Redis the benchmark
starts, and a simulated GPU (chunked prefill by default, as vLLM V1 and SGLang run;
``--engine unchunked`` for the seed's case) into which a 32K-token prompt arrives
every ``--inject-every`` s.

- ``fifo``: no QoS, every request straight to the server;
- ``static``: qosd's buckets at the seed's fixed 60/35/5, no SLO loop;
- ``qosd``: buckets, waiting room, the GPU gate and the SLO loop.

Every cell runs under several seeds (``--seeds``, 11, 12 and 13 by default: seeds no
design was chosen on). A seed picks where in the trace the replay starts, the classes
(a seeded hash: P0 20 %, P1 50 %, P2 30 %; the injected prompts are P1) and, with
``--bursty``, the bursts. Requests are scored by the benchmark's own objectives
(``qosd_sim.objectives``), never by qosd's config; P0 is also reported against a
proven upper bound (``qosd_sim.bound``). qosd is configured as an operator would:
the pool's capacity from a load test of the server that knows nothing of the trace,
and the server's own limits.

Prints a table per policy and class and one per policy, and writes a JSON file (the
means in ``policies``, the worst seed in ``worst``, each seed whole in ``per_seed``),
the markdown tables, the per-request records and two PNG plots of the first seed.
Every field: ``docs/simulator.md``; definitions: ``sim/qosd_sim/results.py``.
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
from qosd_harness import redis_server, source_commit
from qosd_sim.bound import on_time_bound
from qosd_sim.experiment import (
    MODEL,
    CapacityChoice,
    Policy,
    PolicyRun,
    PoolCapacity,
    RatePoint,
    configured_capacity,
    daemon_config,
    run_policy,
    workload_capacity,
)
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import VLLM_A100_BATCHED_TOKENS, GpuModel
from qosd_sim.objectives import CLASSES, SCORINGS, describe
from qosd_sim.openai_experiment import run_policy_openai
from qosd_sim.plots import plot_runs
from qosd_sim.replay import (
    BurstProcess,
    BurstTargets,
    Request,
    TraceRow,
    arrival_shape,
    read_trace,
)
from qosd_sim.results import ClassFacts, RunSamples, policy_summary, timeline
from qosd_sim.seeds import DEVELOPMENT_SEEDS, REPORTED_SEEDS, summed_up
from qosd_sim.workload import SeededWorkload, WorkloadSpec, seeded_workload

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"
HEADLINE = "scaled"


def _pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_table(results: dict[str, Any]) -> str:
    """Two markdown tables of the seeds' means (worst seed in brackets): per policy
    and class, then per policy."""
    worst = results["worst"]
    bound = results["bound"][HEADLINE]
    header = (
        "| policy | class | attained / offered (worst) | attained / admitted | TTFT p99 ms | "
        "TPOT p99 ms | admitted / offered | rejected | timed out | unfinished | "
        "worst wait ms | served token share |"
    )
    lines = [header, "|" + "---|" * 2 + "---:|" * 10]
    for policy, classes in results["policies"].items():
        for name in CLASSES:
            c = classes[name]
            lines.append(
                f"| {policy} | {name} | {_pct(c['attainment_of_offered'])} "
                f"({_pct(worst[policy][name]['attainment_of_offered'])}) | "
                f"{_pct(c['slo_attainment'])} | {_num(c['ttft_p99_ms'])} | "
                f"{_num(c['tpot_p99_ms'])} | {c['admitted']:.0f}/{c['offered']:.0f} | "
                f"{c['rejected']:.0f} | {c['timed_out']:.0f} | {c['unfinished']:.0f} | "
                f"{c['worst_wait_ms']:,.0f} | {_pct(c['served_token_share'])} |"
            )
    lines += [
        "",
        f"P0 bound (mean of seeds, worst): {_pct(bound['P0'])}, {_pct(bound['P0_worst'])}",
        "",
        "| policy | P0 / bound | P0, fixed 500 ms | goodput / saturated over the span (worst) "
        "| trace only | busy | long prompts admitted | qosd unavailable | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, classes in results["policies"].items():
        total = classes["all"]
        errors = sum(classes[name]["errors"] for name in CLASSES)
        unavailable = sum(classes[name].get("unavailable", 0) for name in CLASSES)
        fixed = results["fixed_p0"]["policies"][policy]["P0"]["attainment_of_offered"]
        lines.append(
            f"| {policy} | {_pct(classes['P0'].get('fraction_of_bound'))} | {_pct(fixed)} | "
            f"{total['goodput_span_of_saturated']:.3f} "
            f"({worst[policy]['all']['goodput_span_of_saturated']:.3f}) | "
            f"{total['trace_goodput_span_of_saturated']:.3f} | "
            f"{_pct(total['busy_fraction'])} | "
            f"{total['long_prompts_admitted']:.1f}/{total['long_prompts_offered']:.0f} | "
            f"{unavailable:.0f} | {errors:.0f} |"
        )
    return "\n".join(lines)


RECORD_FIELDS = ("decision", "admitted", "waited_ms", "ttft_ms", "e2e_ms", "completed",
                 "tokens_seen", "error")  # fmt: skip


def _run_record(run: PolicyRun) -> dict[str, Any]:
    return {
        "duration_s": run.duration_s,
        "adjustments": run.adjustments,
        "rates": [[p.t_s, p.pool_rate] for p in run.rates],
        "busy": [list(sample) for sample in run.busy],
        "records": [
            [*dataclasses.astuple(r.request), *(getattr(r, f) for f in RECORD_FIELDS)]
            for r in run.records
        ],
    }


def _load_run(policy: str, run: dict[str, Any]) -> PolicyRun:
    width = len(dataclasses.fields(Request))
    records = []
    for row in run["records"]:
        record = RequestRecord(Request(*row[:width]))
        for name, value in zip(RECORD_FIELDS, row[width:], strict=True):
            setattr(record, name, value)
        records.append(record)
    rates = [RatePoint(t, rate, {}, {}, {}) for t, rate in run["rates"]]
    busy = [(t, b) for t, b in run["busy"]]
    return PolicyRun(Policy(policy), records, rates, run["duration_s"], run["adjustments"], busy)


@dataclasses.dataclass(slots=True)
class SeedRun:
    """One seed of a cell: what was replayed, and each policy's run of it."""

    workload: SeededWorkload
    runs: list[PolicyRun]

    def as_record(self) -> dict[str, Any]:
        w = self.workload
        return {
            "seed": w.seed,
            "trace_start_s": w.trace_start_s,
            "time_compression": w.time_compression,
            "trace_capacity_tokens_s": w.trace_capacity_tokens_s,
            "burst_process": None if w.burst_process is None else w.burst_process.as_dict(),
            "workload": [dataclasses.astuple(r) for r in w.requests],
            "runs": {run.policy.value: _run_record(run) for run in self.runs},
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> SeedRun:
        process = data["burst_process"]
        workload = SeededWorkload(
            data["seed"],
            data["trace_start_s"],
            data["time_compression"],
            data["trace_capacity_tokens_s"],
            [Request(*row) for row in data["workload"]],
            None if process is None else BurstProcess(**process),
        )
        return cls(workload, [_load_run(p, run) for p, run in data["runs"].items()])


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


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        load=args.load,
        duration_s=args.duration,
        mix=args.mix,
        long_prompt_tokens=args.long_prompt_tokens or None,
        inject_every_s=args.inject_every or None,
        inject_tokens=args.inject_tokens,
        inject_output_tokens=args.inject_output,
        inject_class=args.inject_class,
        bursts=None if args.bursty is None else BurstTargets.parse(args.bursty),
    )


def evaluate(
    seed_run: SeedRun,
    args: argparse.Namespace,
    gpu: GpuModel,
    facts: dict[str, ClassFacts],
) -> dict[str, Any]:
    """One seed's results: its workload, the P0 bound under each scoring, and each
    policy's outcomes."""
    drawn = seed_run.workload
    workload = drawn.requests
    trace = [r for r in workload if not r.injected]
    capacity = workload_capacity(gpu, workload, 1.0)  # everything the gateway sent
    p0 = [(r.at_s, r.input_tokens) for r in workload if r.qos_class == "P0"]
    bounds = {
        name: {"P0": on_time_bound(gpu, p0, scoring["P0"], time_limit_s=args.bound_time_limit)}
        for name, scoring in SCORINGS.items()
    }
    result: dict[str, Any] = {
        "seed": drawn.seed,
        "trace_start_s": round(drawn.trace_start_s, 3),
        "time_compression": round(drawn.time_compression, 3),
        "requests": len(workload),
        "offered_load": round(
            sum(r.tokens() for r in trace) / args.duration / drawn.trace_capacity_tokens_s, 3
        ),
        "trace_saturated_capacity_tokens_s": round(drawn.trace_capacity_tokens_s, 1),
        "saturated_capacity_tokens_s": round(capacity, 1),
        "workload_shape": arrival_shape([r.at_s for r in trace], args.duration).as_dict(),
        "burst_process": None if drawn.burst_process is None else drawn.burst_process.as_dict(),
        "bound": {s: {c: b.as_dict() for c, b in by.items()} for s, by in bounds.items()},
        "policies": {},
        "fixed_p0": {},
        "timelines": {},
    }
    for run in seed_run.runs:
        samples = RunSamples(run.duration_s, run.busy, [(p.t_s, p.pool_rate) for p in run.rates])
        by_scoring = {
            name: policy_summary(
                run.records,
                scoring,
                samples,
                window_s=args.duration,
                capacity_tokens_s=capacity,
                facts=facts,
                output_weight=args.output_weight,
            )
            for name, scoring in SCORINGS.items()
        }
        for name, summary in by_scoring.items():
            share = bounds[name]["P0"].share
            attained = summary["P0"]["attainment_of_offered"]
            summary["P0"]["fraction_of_bound"] = (
                round(attained / share, 4) if share and attained is not None else None
            )
        summary = by_scoring[HEADLINE]
        if run.adjustments:
            summary["all"]["adjustments"] = run.adjustments
        result["policies"][run.policy.value] = summary
        result["fixed_p0"][run.policy.value] = {"P0": by_scoring["fixed_p0"]["P0"]}
        result["timelines"][run.policy.value] = timeline(
            run.records,
            facts,
            output_weight=args.output_weight,
            rates=samples.rates,
            busy=run.busy,
            end_s=max(run.duration_s, args.duration),
        )
    return result


def parse_args() -> argparse.Namespace:
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
        "--engine",
        choices=["chunked", "unchunked", "chunked-priority", "unchunked-priority"],
        default="chunked",
        help="the simulated server's prefill: chunked under a token budget per iteration "
        "(vLLM V1, SGLang), or unchunked (vLLM V0, the seed's stall); -priority: the "
        "server schedules by the priority the gateway passes (vLLM's --scheduling-policy "
        "priority), and chunked, caps each prompt's tokens per iteration at "
        "--long-prefill-threshold",
    )
    parser.add_argument(
        "--server",
        choices=["triton", "vllm"],
        default="triton",
        help="triton: a gateway calls Acquire and streams from a simulated Triton through "
        "tritonclient; vllm: the official openai client streams from a simulated vLLM "
        "(qosd sim-vllm), through qosd proxy for static and qosd, with no gateway code",
    )
    parser.add_argument(
        "--long-prefill-threshold",
        type=int,
        default=VLLM_A100_BATCHED_TOKENS // 4,
        help="a -priority chunked engine's most tokens of one prompt per iteration "
        "(vLLM's --long-prefill-token-threshold)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=VLLM_A100_BATCHED_TOKENS,
        help="the chunked engine's token budget per iteration (vLLM's "
        "max_num_batched_tokens; its default on an A100)",
    )
    parser.add_argument(
        "--duration", type=float, default=120.0, help="seconds of arrivals per policy"
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
    targets = BurstTargets()
    parser.add_argument(
        "--bursty",
        nargs="?",
        const="",
        default=None,
        metavar="EMPTY:PEAK:CV",
        help="draw the trace's arrivals from a compound Poisson process of power-law "
        "bursts fitted to these statistics of 1-s bins: the share of empty bins, the "
        "busiest bin over the mean, the inter-arrival CV (default "
        f"{targets.empty_bin_share:g}:{targets.peak_to_mean:g}:{targets.interarrival_cv:g}, "
        "a production code-completion trace's)",
    )
    parser.add_argument(
        "--seeds",
        default=",".join(str(s) for s in REPORTED_SEEDS),
        help="comma-separated seeds, each a whole run of every policy (default: the "
        f"reported seeds; designs are chosen on {DEVELOPMENT_SEEDS})",
    )
    parser.add_argument(
        "--output-weight",
        type=float,
        default=4.0,
        help="qosd's cost.output_weight (output tokens are priced at about four input "
        "tokens by public APIs)",
    )
    parser.add_argument(
        "--long-prompts",
        choices=["admit", "refuse"],
        default="admit",
        help="qosd policies: admit any request the server accepts at its class's rate (a "
        "class may go into debt for one request), or refuse those costing more than 20,000",
    )
    parser.add_argument(
        "--capacity",
        choices=[c.value for c in CapacityChoice],
        default="slo",
        help="the pool's configured capacity, from a load test of the server: what it "
        "serves within P0's objectives, its saturated throughput (optimistic: the SLO "
        "loop must cut it), or half the first (too low: the loop must raise it)",
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
        "--bound-time-limit",
        type=float,
        default=10.0,
        help="seconds the P0 bound's solver may spend on one cluster of requests before "
        "its bound is the relaxation's (still an upper bound, marked inexact)",
    )
    parser.add_argument(
        "--from-records",
        action="store_true",
        help="do not replay: recompute the results, table and plots from the records "
        "file a previous run wrote beside --json",
    )
    parser.add_argument("--json", required=True, help="results file")
    parser.add_argument("--markdown", help="table file (default: beside --json)")
    parser.add_argument("--plots", help="PNG prefix (default: beside --json)")
    return parser.parse_args()


def gpu_model(args: argparse.Namespace) -> GpuModel:
    """The simulated server ``--engine`` names."""
    chunked = args.engine.startswith("chunked")
    priority = args.engine.endswith("-priority")
    return GpuModel(
        prefill_chunk_tokens=args.chunk_tokens if chunked else None,
        long_prefill_token_threshold=args.long_prefill_threshold if chunked and priority else None,
        priority_scheduling=priority,
    )


def main() -> int:
    args = parse_args()
    gpu = gpu_model(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    policies = [Policy(name.strip()) for name in args.policies.split(",")]
    settings = config_settings(args.settings)
    base = Config()
    facts = ClassFacts.from_config(base)
    pool = configured_capacity(
        gpu, args.output_weight, SCORINGS[HEADLINE]["P0"], choice=CapacityChoice(args.capacity)
    )
    qosd_config = daemon_config(
        Policy.QOSD,
        base=base,
        capacity_cost_s=pool.cost_s,
        output_weight=args.output_weight,
        redis_url=None,
        gpu=gpu,
        admit_long_prompts=args.long_prompts == "admit",
        overrides=settings,
    )
    records_path = Path(args.json).with_suffix(".records.json.gz")
    # Before the runs: a folder that is not there must not cost a run's results.
    records_path.parent.mkdir(parents=True, exist_ok=True)
    rows = read_trace(args.trace)
    if args.from_records:
        with gzip.open(records_path, "rt", encoding="utf-8") as handle:
            seed_runs = [SeedRun.from_record(data) for data in json.load(handle)]
    else:
        seed_runs = replay_seeds(args, rows, gpu, seeds, policies, pool, settings)
        with gzip.open(records_path, "wt", encoding="utf-8") as handle:
            json.dump([s.as_record() for s in seed_runs], handle)
    per_seed = [evaluate(s, args, gpu, facts) for s in seed_runs]
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "commit": source_commit(Path(__file__).resolve().parents[1]),
        "trace": args.trace or "bundled sample",
        "engine": gpu.engine,
        "server": args.server,
        "load": args.load,
        "seeds": [s.workload.seed for s in seed_runs],
        "development_seeds": list(DEVELOPMENT_SEEDS),
        "duration_s": args.duration,
        "drain_s": args.drain,
        "class_mix": args.mix,
        "long_prompt_tokens": args.long_prompt_tokens or None,
        "bursty": None if args.bursty is None else BurstTargets.parse(args.bursty).as_dict(),
        "long_prompts": args.long_prompts,
        "inject_every_s": args.inject_every,
        "inject_tokens": args.inject_tokens,
        "inject_class": args.inject_class,
        "output_weight": args.output_weight,
        "qosd_settings": args.settings,
        "scorings": {name: describe(scoring) for name, scoring in SCORINGS.items()},
        "gpu": dataclasses.asdict(gpu),
        "configured_capacity": args.capacity,
        "pool_capacity_rule": pool.rule,
        "pool_capacity_cost_s": round(pool.cost_s, 1),
        "load_test_saturated_cost_s": round(pool.saturated_cost_s, 1),
        **pool.slo.as_dict(),
        "qosd_pool": qosd_config["pools"][MODEL],
        "qosd_max_cost_tokens": {
            n: c["max_cost_tokens"] for n, c in qosd_config["classes"].items()
        },
        **summed_up(per_seed),
        "per_seed": per_seed,
    }
    return write_outputs(args, results, seed_runs[0], facts)


def replay_seeds(
    args: argparse.Namespace,
    rows: list[TraceRow],
    gpu: GpuModel,
    seeds: list[int],
    policies: list[Policy],
    pool: PoolCapacity,
    settings: Callable[[dict[str, Any]], None],
) -> list[SeedRun]:
    """Every seed's workload, replayed under every policy, one after another."""
    seed_runs = []
    with redis_server() as redis:
        for seed in seeds:
            seed_run = SeedRun(seeded_workload(rows, gpu, workload_spec(args), seed), [])
            drawn = seed_run.workload
            trace = [r for r in drawn.requests if not r.injected]
            shape = arrival_shape([r.at_s for r in trace], args.duration)
            print(
                f"seed {seed}: {len(drawn.requests)} requests in {args.duration:.0f}s from "
                f"trace second {drawn.trace_start_s:,.0f} (trace time / "
                f"{drawn.time_compression:.2f}), {gpu.engine} engine; arrivals "
                f"{shape.empty_bin_share:.0%} of 1-s bins empty, peak {shape.peak_to_mean:.1f}x "
                f"the mean, inter-arrival CV "
                + ("n/a" if shape.interarrival_cv is None else f"{shape.interarrival_cv:.1f}"),
                flush=True,
            )
            for policy in policies:
                began = time.monotonic()
                run = run_policy_openai if args.server == "vllm" else run_policy
                seed_run.runs.append(
                    run(
                        policy,
                        drawn.requests,
                        gpu=gpu,
                        capacity_cost_s=pool.cost_s,
                        output_weight=args.output_weight,
                        redis_url=redis.url,
                        drain_s=args.drain,
                        window_s=args.duration,
                        admit_long_prompts=args.long_prompts == "admit",
                        config_overrides=settings if policy is Policy.QOSD else None,
                    )
                )
                print(f"  {policy.value}: ran in {time.monotonic() - began:.0f}s", flush=True)
            seed_runs.append(seed_run)
    return seed_runs


def write_outputs(
    args: argparse.Namespace,
    results: dict[str, Any],
    first: SeedRun,
    facts: dict[str, ClassFacts],
) -> int:
    table = print_table(results)
    print(table)
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    markdown = Path(args.markdown) if args.markdown else json_path.with_suffix(".md")
    markdown.write_text(table + "\n")
    prefix = Path(args.plots) if args.plots else json_path.with_suffix("")
    scoring = SCORINGS[HEADLINE]
    for path in plot_runs(first.runs, scoring, facts, prefix, args.output_weight):
        print(f"wrote {path} (seed {first.workload.seed})")
    print(f"wrote {json_path} and {markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
