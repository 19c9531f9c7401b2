"""The seed's problem and qosd's fix, measured: one trace replayed under every policy.

    python benchmarks/qos_replay.py --trace ../shared/traces/azure2023_conv.csv \
        --load 1.5 --engine chunked --json docs/results/replay_azure_1.5x_chunked.json

Each policy replays the same requests at the same offsets, end to end over real
sockets: the gateway loop (Acquire, stream from a simulated Triton through
``tritonclient``, Release), a qosd daemon on its own keys in a Redis the benchmark
starts, and a simulated GPU (chunked prefill by default, as vLLM V1 and SGLang run;
``--engine unchunked`` for the seed's case) into which a 32K-token prompt arrives
every ``--inject-every`` s.

- ``qosd``: buckets, waiting room, the servers' gate and the SLO loop;
- ``static``: qosd's buckets at the seed's fixed 60/35/5 and the same gate, no SLO
  loop, swept over the pool's capacity (``--static-factors``: 0.6 to 1.4 times the
  load test's), each point a run named ``static@F``;
- ``vllm-native``: no admission: the server's own priority scheduling (the class's
  rank) with a queue cap (``--queue-cap``), refused beyond it, and the client
  retrying as the official ``openai`` SDK does (2 retries, 0.5 s then 1 s, jittered);
- ``fifo-deadline``: no QoS, and clients that give up at their TTFT objective, as
  real clients time out;
- ``fifo`` (not run by default: with no timeouts and no queue cap it scores 0 by
  construction): every request straight to the server.

Every cell runs under ten seeds (``--seeds``, 11 to 20: seeds no design was chosen
on; designs are chosen on 1 to 3). A seed picks where in the trace the replay
starts, the classes (a seeded hash: P0 20 %, P1 50 %, P2 30 %; the injected prompts
are P1) and, with ``--bursty``, the bursts. Requests are scored by the benchmark's own
objectives (``qosd_sim.objectives``), never by qosd's config. qosd is configured as an
operator would: the pool's capacity from a load test of the server that knows
nothing of the trace, and the server's own limits.

Beside the policies, per seed: P0's proven upper bound (``qosd_sim.bound``) and two
achievable references, schedules the engine itself runs with P0 alone
(``qosd_sim.references``): ``P0_online`` (admit when a forward run predicts the
request on time) and ``P0_clairvoyant`` (the bound's set, replayed).

The headline goodput is the trace's requests' (``trace_goodput_of_trace_saturated``:
against the FCFS-saturated throughput of the trace, a reference, not a ceiling); the
injected prompts' goodput is reported on its own line. ``frontier`` lists every
policy's mean P0 and goodput (the static sweep's points included), ``intervals`` the
paired bootstrap 95 % intervals of qosd minus each baseline over the seeds.

**Pinned runs.** A run records its commit as it starts and refuses a tree whose
sources differ from it (``--dev`` runs one anyway, marked as a development run), or
runs from a clean worktree of ``--commit REV``. One run at a time on a machine (a
lock; a second waits). Each run records how late the gateway sent (p99 beyond 50 ms
marks the run ``late_run``) and the GPU time the simulated server lost to late
wake-ups.

Prints a table per policy and class and one per policy, and writes a JSON file (the
means in ``policies``, the worst seed in ``worst``, each seed whole in ``per_seed``),
the markdown tables, the per-request records, two PNG plots of the first seed and a
Pareto figure of the cell (``_pareto.png``). Every field: ``docs/simulator.md``;
definitions: ``sim/qosd_sim/results.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from qosd.config import Config
from qosd_harness import (
    changed_paths,
    clean_worktree,
    one_at_a_time,
    redis_server,
    source_commit,
)
from qosd_sim.bound import on_time_bound
from qosd_sim.experiment import (
    MODEL,
    CapacityChoice,
    Clock,
    Policy,
    PolicyRun,
    PoolCapacity,
    RatePoint,
    configured_capacity,
    daemon_config,
    run_policy,
    workload_capacity,
)
from qosd_sim.frontier import frontier_of, headline_of
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import VLLM_A100_BATCHED_TOKENS, GpuModel
from qosd_sim.objectives import CLASSES, SCORINGS, describe
from qosd_sim.openai_experiment import run_policy_openai
from qosd_sim.plots import plot_pareto, plot_runs
from qosd_sim.references import p0_clairvoyant, p0_online
from qosd_sim.replay import (
    BurstProcess,
    BurstTargets,
    Request,
    TraceRow,
    arrival_shape,
    read_trace,
)
from qosd_sim.results import ClassFacts, RunSamples, lateness, policy_summary, timeline
from qosd_sim.seeds import DEVELOPMENT_SEEDS, REPORTED_SEEDS, paired_intervals, summed_up
from qosd_sim.workload import SeededWorkload, WorkloadSpec, seeded_workload

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"
HEADLINE = "scaled"


def _pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _interval(figure: dict[str, Any] | None) -> str:
    if not figure or figure.get("mean") is None:
        return "n/a"
    return f"{figure['mean']:+.3f} [{figure['low']:+.3f}, {figure['high']:+.3f}]"


def print_table(results: dict[str, Any]) -> str:
    """Two markdown tables of the seeds' means (worst seed in brackets): per policy
    and class, then per policy."""
    worst = results["worst"]
    bound = results["bound"][HEADLINE]
    header = (
        "| policy | class | attained / offered (worst) | attained / admitted | TTFT p99 ms | "
        "TPOT p99 ms | admitted / offered | rejected | timed out | gave up | unfinished | "
        "worst wait ms | served token share |"
    )
    lines = [header, "|" + "---|" * 2 + "---:|" * 11]
    for policy, classes in results["policies"].items():
        for name in CLASSES:
            c = classes[name]
            lines.append(
                f"| {policy} | {name} | {_pct(c['attainment_of_offered'])} "
                f"({_pct(worst[policy][name]['attainment_of_offered'])}) | "
                f"{_pct(c['slo_attainment'])} | {_num(c['ttft_p99_ms'])} | "
                f"{_num(c['tpot_p99_ms'])} | {c['admitted']:.0f}/{c['offered']:.0f} | "
                f"{c['rejected']:.0f} | {c['timed_out']:.0f} | {c.get('gave_up', 0):.0f} | "
                f"{c['unfinished']:.0f} | "
                f"{c['worst_wait_ms']:,.0f} | {_pct(c['served_token_share'])} |"
            )
    references = results.get("references", {})
    online = references.get("P0_online", {})
    clairvoyant = references.get("P0_clairvoyant", {})
    lines += [
        "",
        f"P0 on time, of offered (mean of seeds, worst): proven bound {_pct(bound['P0'])} "
        f"({_pct(bound['P0_worst'])}); achievable with P0 alone on this engine: the "
        f"bound's set replayed {_pct(clairvoyant.get('P0'))} "
        f"({_pct(clairvoyant.get('P0_worst'))}), online forward-run admission "
        f"{_pct(online.get('P0'))} ({_pct(online.get('P0_worst'))})",
        "",
        "Trace goodput: the trace's requests on time, tokens/s over the span, against the "
        "trace's FCFS-saturated throughput (a reference, not a ceiling). The injected "
        "32K prompts on their own line.",
        "",
        "| policy | P0 of offered (worst) | P0 / bound | P0 / online | P0, fixed 500 ms "
        "| trace goodput (worst) | injected goodput, tokens/s | busy | long prompts admitted "
        "| gateway late p99 ms | GPU s lost | qosd unavailable | errors |",
        "|---|" + "---:|" * 12,
    ]
    for policy, classes in results["policies"].items():
        total = classes["all"]
        errors = sum(classes[name]["errors"] for name in CLASSES)
        unavailable = sum(classes[name].get("unavailable", 0) for name in CLASSES)
        fixed = results["fixed_p0"]["policies"][policy]["P0"]["attainment_of_offered"]
        lost = total.get("gpu_lost_s")
        lines.append(
            f"| {policy} | {_pct(classes['P0']['attainment_of_offered'])} "
            f"({_pct(worst[policy]['P0']['attainment_of_offered'])}) | "
            f"{_pct(classes['P0'].get('fraction_of_bound'))} | "
            f"{_pct(classes['P0'].get('fraction_of_online'))} | {_pct(fixed)} | "
            f"{_ratio(total.get('trace_goodput_of_trace_saturated'))} "
            f"({_ratio(worst[policy]['all'].get('trace_goodput_of_trace_saturated'))}) | "
            f"{_num(total.get('injected_goodput_tokens_s'))} | "
            f"{_pct(total['busy_fraction'])} | "
            f"{total['long_prompts_admitted']:.1f}/{total['long_prompts_offered']:.0f} | "
            f"{_num(total.get('gateway_late_p99_ms'))} | "
            f"{'-' if lost is None else f'{lost:.2f}'} | {unavailable:.0f} | {errors:.0f} |"
        )
    intervals = results.get("intervals") or {}
    if intervals:
        lines += [
            "",
            "qosd minus each baseline, mean over seeds [paired bootstrap 95 % interval]:",
            "",
            "| baseline | P0 of offered | trace goodput |",
            "|---|---:|---:|",
        ]
        for baseline, figures in intervals.items():
            cells = [_interval(figures[figure]) for figure in ("P0", "goodput")]
            lines.append(f"| {baseline} | {cells[0]} | {cells[1]} |")
    headline = results.get("headline")
    if headline:
        lines += [
            "",
            f"Headline: qosd P0 {_pct(headline['qosd']['P0'])}, trace goodput "
            f"{_ratio(headline['qosd']['goodput'])}; best baseline at its P0 "
            f"({headline['rule']}): {headline['baseline']} P0 "
            f"{_pct(headline['baseline_P0'])}, goodput {_ratio(headline['baseline_goodput'])}.",
        ]
    return "\n".join(lines)


RECORD_FIELDS = ("decision", "admitted", "waited_ms", "ttft_ms", "e2e_ms", "completed",
                 "tokens_seen", "error", "late_ms", "retries")  # fmt: skip


def _run_record(run: PolicyRun) -> dict[str, Any]:
    return {
        "duration_s": run.duration_s,
        "adjustments": run.adjustments,
        "rates": [[p.t_s, p.pool_rate] for p in run.rates],
        "busy": [list(sample) for sample in run.busy],
        "gpu_lost_s": run.gpu_lost_s,
        "gpu_late_wakeups": run.gpu_late_wakeups,
        "records": [
            [*dataclasses.astuple(r.request), *(getattr(r, f) for f in RECORD_FIELDS)]
            for r in run.records
        ],
    }


def _load_run(name: str, run: dict[str, Any]) -> PolicyRun:
    """A run from a records file; ``name`` is its name in results (``static@0.6``).
    Files from before issue 37 lack the last record fields: they keep their defaults."""
    policy, _, factor = name.partition("@")
    width = len(dataclasses.fields(Request))
    records = []
    for row in run["records"]:
        record = RequestRecord(Request(*row[:width]))
        for field_name, value in zip(RECORD_FIELDS, row[width:], strict=False):
            setattr(record, field_name, value)
        records.append(record)
    rates = [RatePoint(t, rate, {}, {}, {}) for t, rate in run["rates"]]
    busy = [(t, b) for t, b in run["busy"]]
    return PolicyRun(
        Policy(policy), records, rates, run["duration_s"], run["adjustments"], busy,
        capacity_factor=float(factor) if factor else None,
        gpu_lost_s=run.get("gpu_lost_s"), gpu_late_wakeups=run.get("gpu_late_wakeups"),
    )  # fmt: skip


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
            "runs": {run.name: _run_record(run) for run in self.runs},
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
    """One seed's results: its workload, the P0 bound under each scoring, the
    achievable P0 references (headline scoring), and each policy's outcomes."""
    drawn = seed_run.workload
    workload = drawn.requests
    trace = [r for r in workload if not r.injected]
    capacity = workload_capacity(gpu, workload, 1.0)  # everything the gateway sent
    p0_requests = [r for r in workload if r.qos_class == "P0"]
    p0 = [(r.at_s, r.input_tokens) for r in p0_requests]
    bounds = {
        name: {"P0": on_time_bound(gpu, p0, scoring["P0"], time_limit_s=args.bound_time_limit)}
        for name, scoring in SCORINGS.items()
    }
    objectives = SCORINGS[HEADLINE]["P0"]
    references = {
        "P0_online": p0_online(gpu, p0_requests, objectives),
        "P0_clairvoyant": p0_clairvoyant(
            gpu, p0_requests, objectives, bounds[HEADLINE]["P0"].chosen
        ),
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
        "references": {name: ref.as_dict() for name, ref in references.items()},
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
                trace_capacity_tokens_s=drawn.trace_capacity_tokens_s,
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
        online = references["P0_online"].share
        attained = summary["P0"]["attainment_of_offered"]
        summary["P0"]["fraction_of_online"] = (
            round(attained / online, 4) if online and attained is not None else None
        )
        summary["all"]["capacity_factor"] = run.capacity_factor
        summary["all"]["gpu_lost_s"] = run.gpu_lost_s
        summary["all"]["gpu_late_wakeups"] = run.gpu_late_wakeups
        if run.adjustments:
            summary["all"]["adjustments"] = run.adjustments
        result["policies"][run.name] = summary
        result["fixed_p0"][run.name] = {"P0": by_scoring["fixed_p0"]["P0"]}
        result["timelines"][run.name] = timeline(
            run.records,
            facts,
            output_weight=args.output_weight,
            rates=samples.rates,
            busy=run.busy,
            end_s=max(run.duration_s, args.duration),
        )
    return result


def parse_args() -> argparse.Namespace:
    return build_parser().parse_args()


#: The policies a cell runs by default, by ``--server``: the simulated vLLM serves
#: behind qosd's proxy or none, so it has no queue cap or client timeouts of its own.
DEFAULT_POLICIES = {"triton": "qosd,static,vllm-native,fifo-deadline", "vllm": "qosd,static,fifo"}


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (also how other benchmarks name a cell the same way)."""
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
        choices=list(ENGINES),
        default="chunked",
        help="the simulated server's prefill: chunked under a token budget per iteration "
        "(vLLM V1, SGLang; chunked-512: a 512-token budget, Sarathi-Serve's), or "
        "unchunked (vLLM V0, the seed's stall); -priority: the server schedules by the "
        "priority the gateway passes (vLLM's --scheduling-policy priority), and chunked, "
        "caps each prompt's tokens per iteration at --long-prefill-threshold",
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
        "--clock",
        choices=[c.value for c in Clock],
        default=Clock.VIRTUAL.value,
        help="virtual (default): the daemon, the simulated Triton and the gateway in one "
        "process on a virtual clock, the daemon on the embedded store (docs/yardstick.md"
        "#virtual-time): as fast as the CPU allows, the same on a busy machine, several "
        "at once; real: each its own process over sockets, on Redis, in real time, one "
        "at a time (--server vllm is always real)",
    )
    parser.add_argument(
        "--engine-passes",
        type=float,
        default=None,
        metavar="SECONDS",
        help="virtual time: the server also reports what its passes carried this often, "
        "as `qosd scrape --engine vllm` reads a vLLM server's counters (the SLO loop "
        "then learns the decode step from them); default: latencies only",
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
    parser.add_argument(
        "--policies",
        help="comma-separated, of qosd, static (swept over --static-factors), "
        "vllm-native, fifo-deadline, fifo (default: "
        + "; ".join(f"{k}: {v}" for k, v in DEFAULT_POLICIES.items())
        + ")",
    )
    parser.add_argument(
        "--static-factors",
        default="0.6,0.8,1.0,1.2,1.4",
        help="static's sweep: the pool's capacity as these multiples of the load test's",
    )
    parser.add_argument(
        "--queue-cap",
        type=int,
        default=2 * GpuModel().max_batch,
        help="vllm-native: the server refuses a request while this many are in flight, "
        "waiting and running (vLLM's --max-num-queued-reqs, 503 beyond; default: twice "
        "the batch slots, 256 running and 256 waiting)",
    )
    parser.add_argument(
        "--commit",
        metavar="REV",
        help="run from a clean git worktree of this commit, whatever this checkout holds",
    )
    parser.add_argument(
        "--dev",
        action="store_true",
        help="a development run: allowed from a tree whose sources differ from its "
        "commit, and marked so in the results (a reported run refuses such a tree)",
    )
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
    return parser


#: The engines ``--engine`` names: (chunked, the budget if not --chunk-tokens, priority).
ENGINES = {
    "chunked": (True, None, False),
    "chunked-512": (True, 512, False),
    "unchunked": (False, None, False),
    "chunked-priority": (True, None, True),
    "unchunked-priority": (False, None, True),
}


def gpu_model(args: argparse.Namespace) -> GpuModel:
    """The simulated server ``--engine`` names."""
    chunked, budget, priority = ENGINES[args.engine]
    return GpuModel(
        prefill_chunk_tokens=(budget or args.chunk_tokens) if chunked else None,
        long_prefill_token_threshold=args.long_prefill_threshold if chunked and priority else None,
        priority_scheduling=priority,
    )


#: The sources a run depends on: a reported run refuses a tree where any differ.
SOURCES = ("qosd", "sim", "clients", "harness", "benchmarks", "proto", "pyproject.toml")
ROOT = Path(__file__).resolve().parents[1]
OUTPUT_FLAGS = ("--json", "--markdown", "--plots", "--trace")


def contenders(args: argparse.Namespace) -> list[tuple[Policy, float | None]]:
    """The runs of each seed: a policy, and static's capacity factor for each point
    of its sweep (None for the rest)."""
    factors = [float(f) for f in args.static_factors.split(",") if f.strip()]
    runs: list[tuple[Policy, float | None]] = []
    names = args.policies or DEFAULT_POLICIES[args.server]
    for name in (n.strip() for n in names.split(",") if n.strip()):
        policy = Policy(name)
        if args.server == "vllm" and policy in (Policy.VLLM_NATIVE, Policy.FIFO_DEADLINE):
            raise SystemExit(f"--server vllm runs fifo, static and qosd only, not {name}")
        if policy is Policy.STATIC:
            runs += [(policy, factor) for factor in factors]
        else:
            runs.append((policy, None))
    return runs


def pinned_rerun(args: argparse.Namespace) -> int:
    """``--commit REV``: this command again, from a clean worktree of REV, its paths
    made absolute; that run pins itself (its tree is clean) and takes the lock."""
    argv: list[str] = []
    words = iter(sys.argv[1:])
    for word in words:
        flag, equals, value = word.partition("=")
        if flag == "--commit":
            if not equals:
                next(words, None)
        elif flag in OUTPUT_FLAGS and equals:
            argv.append(f"{flag}={Path(value).resolve()}")
        elif word in OUTPUT_FLAGS:
            argv += [word, str(Path(next(words)).resolve())]
        else:
            argv.append(word)
    if args.trace and not any(w.partition("=")[0] == "--trace" for w in argv):
        argv += ["--trace", str(Path(args.trace).resolve())]  # the default, from here
    with clean_worktree(ROOT, args.commit) as tree:
        script = tree / "benchmarks" / "qos_replay.py"
        print(f"running from a clean worktree of {args.commit} at {tree}", flush=True)
        return subprocess.run(
            [sys.executable, str(script), *argv], **pinned_process(tree), check=False
        ).returncode


def pinned_process(tree: Path) -> dict[str, Any]:
    """The environment and directory a pinned run starts in: the worktree's packages
    first on ``PYTHONPATH``, and the worktree as the working directory. Its daemons,
    proxies and simulated servers start as ``python -m qosd.cli``, which puts the
    working directory first on ``sys.path``: from the caller's checkout they ran its
    ``qosd``, not the pinned commit's, in every real-time and ``--server vllm`` run."""
    paths = [str(tree / part) for part in ("", "clients", "sim", "harness")]
    return {"env": {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}, "cwd": tree}


def main() -> int:
    args = parse_args()
    if args.commit:
        return pinned_rerun(args)
    if clock_of(args) is Clock.VIRTUAL:
        # Nothing to share a machine with: a run in virtual time is the same beside
        # another (a replay in real time should still run alone).
        return pinned_cell(args)
    with one_at_a_time("qosd-qos-replay"):
        return pinned_cell(args)


def clock_of(args: argparse.Namespace) -> Clock:
    """The run's clock: ``--server vllm`` runs a real proxy and server, in real time."""
    return Clock.REAL if args.server == "vllm" else Clock(args.clock)


def pinned_cell(args: argparse.Namespace) -> int:
    # Recorded as the run starts (after any wait for the lock), and refused where
    # the sources differ from it: a tree edited during a long matrix must not name
    # its results. Each policy's daemon starts from this tree: an edit during the
    # run is seen at its end and marks it a development run (--commit runs from a
    # worktree no one edits).
    commit = source_commit(ROOT)
    changed = changed_paths(ROOT, SOURCES)
    if changed and not args.dev and not args.from_records:
        raise SystemExit(
            "refusing to run from a tree whose sources differ from its commit "
            f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}): commit "
            "them, run --commit REV, or mark a development run with --dev"
        )
    return run_cell(args, commit, changed)


def run_cell(args: argparse.Namespace, commit: str, changed: list[str]) -> int:
    """Replays (or reloads, ``--from-records``) one cell and writes its results."""
    gpu = gpu_model(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs = contenders(args)
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
    started_at = time.time()
    load_at_start = os.getloadavg()[0]
    if args.from_records:
        with gzip.open(records_path, "rt", encoding="utf-8") as handle:
            seed_runs = [SeedRun.from_record(data) for data in json.load(handle)]
    else:
        seed_runs = replay_seeds(args, rows, gpu, seeds, runs, pool, settings)
        with gzip.open(records_path, "wt", encoding="utf-8") as handle:
            json.dump([s.as_record() for s in seed_runs], handle)
    per_seed = [evaluate(s, args, gpu, facts) for s in seed_runs]
    summed = summed_up(per_seed)
    changed_at_end = [] if args.from_records else changed_paths(ROOT, SOURCES)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "commit": commit,
        "development_run": bool(changed or changed_at_end)
        or args.dev
        or not set(seeds).isdisjoint(DEVELOPMENT_SEEDS),
        "changed_at_start": changed,
        "changed_at_end": changed_at_end,
        "started_at_unix_s": round(started_at),
        "load_average_at_start": round(load_at_start, 2),
        "trace": args.trace or "bundled sample",
        "engine": gpu.engine,
        "server": args.server,
        "clock": clock_of(args).value,
        "engine_passes_s": args.engine_passes,
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
        "static_factors": [f for p, f in runs if p is Policy.STATIC],
        "queue_cap": args.queue_cap,
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
        **summed,
        "references": summed_references(per_seed),
        "frontier": frontier_of(summed["policies"], summed["worst"]),
        "intervals": paired_intervals(per_seed),
        "late_runs": [
            {"seed": s["seed"], "policy": name}
            for s in per_seed
            for name, summary in s["policies"].items()
            if summary["all"].get("late_run")
        ],
        "per_seed": per_seed,
    }
    results["headline"] = headline_of(results)
    return write_outputs(args, results, seed_runs[0], facts)


def summed_references(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each reference's share of P0 on time: the mean over seeds, and the worst."""
    out: dict[str, Any] = {}
    for name in per_seed[0]["references"]:
        shares = [s["references"][name]["share"] for s in per_seed]
        present = [v for v in shares if v is not None]
        out[name] = {
            "P0": round(statistics.fmean(present), 4) if present else None,
            "P0_worst": min(present) if present else None,
        }
    return out


def replay_seeds(
    args: argparse.Namespace,
    rows: list[TraceRow],
    gpu: GpuModel,
    seeds: list[int],
    runs: list[tuple[Policy, float | None]],
    pool: PoolCapacity,
    settings: Callable[[dict[str, Any]], None],
) -> list[SeedRun]:
    """Every seed's workload, replayed under every contender, one after another."""
    seed_runs = []
    clock = clock_of(args)
    with contextlib.ExitStack() as stack:
        # In virtual time the daemon runs on the embedded store.
        redis_url = None if clock is Clock.VIRTUAL else stack.enter_context(redis_server()).url
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
            for policy, factor in runs:
                began = time.monotonic()
                if args.server == "vllm":
                    run = run_policy_openai(
                        policy, drawn.requests, gpu=gpu,
                        capacity_cost_s=pool.cost_s * (factor or 1.0),
                        output_weight=args.output_weight, redis_url=redis_url,
                        drain_s=args.drain, window_s=args.duration,
                        admit_long_prompts=args.long_prompts == "admit",
                        config_overrides=settings if policy is Policy.QOSD else None,
                    )  # fmt: skip
                    run.capacity_factor = factor
                else:
                    run = run_policy(
                        policy, drawn.requests, gpu=gpu, capacity_cost_s=pool.cost_s,
                        output_weight=args.output_weight, redis_url=redis_url,
                        drain_s=args.drain, window_s=args.duration,
                        admit_long_prompts=args.long_prompts == "admit",
                        config_overrides=settings if policy is Policy.QOSD else None,
                        capacity_factor=factor, objectives=SCORINGS[HEADLINE],
                        queue_cap=args.queue_cap, clock=clock,
                        passes_every_s=args.engine_passes,
                    )  # fmt: skip
                seed_run.runs.append(run)
                late = lateness([r.late_ms for r in run.records])
                lost = "n/a" if run.gpu_lost_s is None else f"{run.gpu_lost_s:.2f}s"
                print(
                    f"  {run.name}: ran in {time.monotonic() - began:.0f}s; gateway late p99 "
                    f"{late['gateway_late_p99_ms']:.0f} ms"
                    + (" (marked late)" if late["late_run"] else "")
                    + f"; GPU time lost {lost}",
                    flush=True,
                )
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
    # Over time, one run of each policy: static at the load test's capacity.
    shown = [run for run in first.runs if run.capacity_factor in (None, 1.0)]
    for path in plot_runs(shown, scoring, facts, prefix, args.output_weight):
        print(f"wrote {path} (seed {first.workload.seed})")
    print(f"wrote {plot_pareto(results, prefix)}")
    print(f"wrote {json_path} and {markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
