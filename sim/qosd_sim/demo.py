"""``qosd demo``: the seed's problem beside qosd's fix, on one machine, in two minutes.

It replays the bundled Azure conversation trace sample (CC BY 4.0, see
``traces/README.md``) at 1.5x a simulated GPU's capacity, with a 32K-token prompt
every 10 s, twice, on exactly the same requests: first with no QoS (every request
straight to the server, first come first served), then through a qosd daemon on the
embedded store (or Redis, with a URL). Classes come from a seeded hash (P0 20 %,
P1 50 %, P2 30 %), whatever a prompt's length; the 32K prompts are P1, an ordinary
user's. The gateway loop is the real one: Acquire, stream through ``tritonclient``,
Release. The engine is unchunked by default, the seed's case: a 32K prefill stalls
every stream for seconds.

It prints a line per class every five seconds, then one summary of both runs side by
side and one picture of both (TTFT and TPOT of every request by arrival).
Requests are scored by the benchmark's objectives (``qosd_sim.objectives``).
``benchmarks/qos_replay.py`` runs the full comparison (static buckets too, several
seeds, both engines, a proven bound).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from qosd.config import Config
from qosd.control.windows import percentiles
from qosd_sim.experiment import (
    CapacityChoice,
    Policy,
    PolicyRun,
    RatePoint,
    calibrated_workload,
    configured_capacity,
    run_policy,
    workload_capacity,
)
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import CLASSES, SCALED
from qosd_sim.plots import plot_runs
from qosd_sim.replay import ClassRule, Request, read_trace
from qosd_sim.results import ClassFacts, RunSamples, policy_summary

OUTPUT_WEIGHT = 4.0
NAMES = {Policy.FIFO: "no QoS", Policy.QOSD: "qosd"}


def run_demo(
    config: Config,
    *,
    duration_s: float,
    load: float,
    out_dir: str,
    trace: str | None = None,
    inject_every_s: float = 10.0,
    engine: str = "unchunked",
) -> int:
    gpu = GpuModel() if engine == "chunked" else GpuModel(prefill_chunk_tokens=None)
    workload, _, _ = calibrated_workload(
        read_trace(trace),
        gpu,
        ClassRule(),
        load=load,
        duration_s=duration_s,
        inject_every_s=inject_every_s,
    )
    capacity = workload_capacity(gpu, workload, 1.0)
    pool = configured_capacity(gpu, OUTPUT_WEIGHT, SCALED["P0"], choice=CapacityChoice.SLO)
    store = f"Redis {config.redis.url}" if config.redis.url else "the embedded store"
    stall = GpuModel(prefill_chunk_tokens=None).prefill_s([32_768])
    print(
        f"qosd demo: {len(workload)} requests over {duration_s:.0f}s at {load:g}x a simulated "
        f"GPU's capacity (~{capacity:,.0f} tokens/s; {engine} prefill"
        + (f": a 32K prompt stalls every stream for {stall:.1f}s" if not gpu.chunked else "")
        + f"), with a 32K-token prompt every {inject_every_s:g}s; replayed with no QoS, then "
        f"through qosd on {store}. Ctrl-C stops early.",
        flush=True,
    )
    runs: list[PolicyRun] = []
    ctrl_c = _CtrlC()
    previous = signal.signal(signal.SIGINT, ctrl_c)
    try:
        interrupted = _run_both(runs, ctrl_c, workload, gpu, pool.cost_s, config, duration_s)
    finally:
        signal.signal(signal.SIGINT, previous)
    _report(runs, config, capacity, duration_s, out_dir)
    return 130 if interrupted else 0


class _CtrlC:
    """Ctrl-C as a flag as well as a KeyboardInterrupt. asyncio's own handler only
    cancels the run's main task, and a run whose cancellation is swallowed on its way
    out (a busy machine once let the demo finish both runs after Ctrl-C) would go on
    to the next run; the flag stops the demo between runs whatever became of it."""

    def __init__(self) -> None:
        self.pressed = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True
        signal.default_int_handler(signum, frame)


def _run_both(
    runs: list[PolicyRun],
    ctrl_c: _CtrlC,
    workload: Sequence[Request],
    gpu: GpuModel,
    capacity_cost_s: float,
    config: Config,
    duration_s: float,
) -> bool:
    """Replays the workload with no QoS, then through qosd, into ``runs``; True when
    Ctrl-C stopped it."""
    for number, policy in enumerate((Policy.FIFO, Policy.QOSD), start=1):
        print(f"\nrun {number}/2: {NAMES[policy]}", flush=True)
        records: list[RequestRecord] = []
        started = time.monotonic()
        try:
            runs.append(
                run_policy(
                    policy,
                    workload,
                    gpu=gpu,
                    capacity_cost_s=capacity_cost_s,
                    output_weight=OUTPUT_WEIGHT,
                    redis_url=config.redis.url,
                    drain_s=10.0,
                    window_s=duration_s,
                    base_config=config,
                    on_record=records.append,
                    on_tick=_ticker(records),
                )
            )
        except KeyboardInterrupt:
            runs.append(PolicyRun(policy, records, duration_s=time.monotonic() - started))
        if ctrl_c.pressed:
            print("\ninterrupted: stopping the daemon and the simulated server ...", flush=True)
            return True
    return False


def _report(
    runs: list[PolicyRun], config: Config, capacity: float, duration_s: float, out_dir: str
) -> None:
    """The report of both runs (or of what ran before Ctrl-C), and their plots."""
    facts = ClassFacts.from_config(config)
    summaries = {
        run.policy: policy_summary(
            run.records,
            SCALED,
            RunSamples(max(run.duration_s, 1.0), run.busy),
            window_s=min(duration_s, max(run.duration_s, 1.0)),
            capacity_tokens_s=capacity,
            facts=facts,
        )
        for run in runs
    }
    print("\nqosd demo report: the same requests, with no QoS and through qosd")
    print(report(summaries))
    qosd = next((run for run in runs if run.policy is Policy.QOSD), None)
    if qosd is not None and qosd.adjustments:
        print("SLO loop changes:\n  " + "\n  ".join(qosd.adjustments[:6]))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for path in plot_runs(runs, SCALED, facts, Path(out_dir) / "qosd_demo", OUTPUT_WEIGHT):
        print(f"plot: {path}")
    print(
        "\nThe full comparison (static buckets too, both engines, several seeds, P0's proven "
        "bound): python benchmarks/qos_replay.py --json r.json"
    )


def _ticker(records: list[RequestRecord]) -> Callable[[float, RatePoint | None], None]:
    """Every five seconds: per class, requests answered so far, and the p99 TTFT and
    TPOT of those that arrived in the last 10 s and completed."""

    def tick(t_s: float, rates: RatePoint | None) -> None:
        if round(t_s) % 5:
            return
        parts = []
        for name in CLASSES:
            recent = [
                r
                for r in records
                if r.request.qos_class == name and r.completed and r.request.at_s >= t_s - 10
            ]
            ttft = percentiles([r.ttft_ms for r in recent if r.ttft_ms is not None])
            tpot = percentiles([t for r in recent if (t := r.tpot_ms) is not None])
            parts.append(
                f"{name} {sum(1 for r in records if r.request.qos_class == name):>4} done, "
                f"TTFT p99 {_ms(ttft.p99 if ttft else None):>8}, "
                f"TPOT p99 {_ms(tpot.p99 if tpot else None):>7}"
            )
        rate = f"  R {rates.pool_rate:,.0f}/s" if rates is not None else ""
        print(f"t={t_s:3.0f}s  " + " | ".join(parts) + rate, flush=True)

    return tick


def report(summaries: dict[Policy, dict[str, Any]]) -> str:
    """The runs side by side, one row per figure."""
    policies = list(summaries)
    rows: list[tuple[str, list[str]]] = []
    for name in CLASSES:
        label = "served" if not SCALED[name].has_slo else "on time"
        rows.append(
            (
                f"{name} {label}, of offered (admitted)",
                [
                    f"{_pct(summaries[p][name]['attainment_of_offered'])} "
                    f"({summaries[p][name]['admitted']}/{summaries[p][name]['offered']})"
                    for p in policies
                ],
            )
        )
        rows.append(
            (
                f"{name} TTFT / TPOT p99",
                [
                    f"{_ms(summaries[p][name]['ttft_p99_ms'])} / "
                    f"{_ms(summaries[p][name]['tpot_p99_ms'])}"
                    for p in policies
                ],
            )
        )
    rows.append(
        (
            "32K prompts admitted / on time",
            [
                f"{summaries[p]['all']['long_prompts_admitted']} / "
                f"{summaries[p]['all']['long_prompts_attained']} of "
                f"{summaries[p]['all']['long_prompts_offered']}"
                for p in policies
            ],
        )
    )
    rows.append(
        (
            "goodput over the span / saturated",
            [f"{summaries[p]['all']['goodput_span_of_saturated']:.2f}" for p in policies],
        )
    )
    width = max(len(label) for label, _ in rows)
    header = f"  {'':<{width}}" + "".join(f"  {NAMES[p]:>22}" for p in policies)
    lines = [header]
    lines += [f"  {label:<{width}}" + "".join(f"  {v:>22}" for v in vs) for label, vs in rows]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"
