"""``qosd demo``: the seed's story on one machine, in about a minute, with no Redis.

It starts a qosd daemon (embedded store unless a Redis URL is given) and a simulated
Triton server that reports latencies to it, then replays the bundled Azure
conversation trace sample (CC BY 4.0, see ``examples/README.md``) at 1.5× the
simulated GPU's capacity, with a 32K-token prompt every 10 s. Classes come from a
seeded hash (P0 20 %, P1 50 %, P2 30 %), whatever a prompt's length; the 32K prompts
are P1, an ordinary user's. The gateway loop is the real one: Acquire, stream through
``tritonclient``, Release.

Every two seconds it prints a table per class; at the end (or on Ctrl-C) a report and
the plots. ``benchmarks/qos_replay.py`` runs the same experiment against no QoS and
static buckets, side by side.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

from qosd.config import Config
from qosd.slo import percentiles
from qosd_sim.experiment import (
    MODEL,
    Policy,
    PolicyRun,
    RatePoint,
    calibrated_workload,
    configured_capacity,
    run_policy,
)
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.plots import plot_runs
from qosd_sim.replay import ClassRule, read_trace
from qosd_sim.results import Objectives, policy_summary


def run_demo(
    config: Config,
    *,
    duration_s: float,
    load: float,
    out_dir: str,
    trace: str | None = None,
    inject_every_s: float = 10.0,
) -> int:
    gpu = GpuModel()
    output_weight = 4.0
    workload, capacity, _ = calibrated_workload(
        read_trace(trace),
        gpu,
        ClassRule(),
        load=load,
        duration_s=duration_s,
        inject_every_s=inject_every_s,
    )
    pool = configured_capacity(gpu, workload, output_weight, config, window_s=duration_s)
    cost_capacity = pool.cost_s
    objectives = Objectives.from_config(config)
    class_names = sorted(config.classes, key=lambda n: config.classes[n].priority)
    records: list[RequestRecord] = []
    interactive = sys.stdout.isatty()
    store = f"redis {config.redis.url}" if config.redis.url else "the embedded store"
    print(
        f"qosd demo: a daemon on {store}, a simulated Triton GPU (~{capacity:,.0f} tokens/s "
        f"on this trace; 32K prefill ~{gpu.prefill_s([32_768]):.1f}s unchunked), and "
        f"{len(workload)} requests over {duration_s:.0f}s at {load:g}x capacity, plus a "
        f"32K-token prompt every {inject_every_s:g}s. Ctrl-C stops early.\n",
        flush=True,
    )

    def tick(t_s: float, rates: RatePoint | None) -> None:
        if int(t_s) % 2:
            return
        recent = [r for r in records if r.completed and r.request.at_s >= t_s - 10]
        lines = [
            f"t={t_s:4.0f}s  pool rate R {rates.pool_rate if rates else 0:,.0f} cost/s "
            f"(configured {cost_capacity:,.0f})",
            f"  {'class':<6}{'admitted':>10}{'rejected':>10}{'waiting':>9}"
            f"{'TTFT p99':>11}{'TPOT p99':>11}{'rate/s':>10}",
        ]
        for name in class_names:
            mine = [r for r in records if r.request.qos_class == name]
            ttft = percentiles(
                [r.ttft_ms for r in recent if r.request.qos_class == name and r.ttft_ms]
            )
            tpot = percentiles(
                [t for r in recent if r.request.qos_class == name and (t := r.tpot_ms)]
            )
            lines.append(
                f"  {name:<6}{sum(r.admitted for r in mine):>10}"
                f"{sum(not r.admitted for r in mine):>10}"
                f"{rates.waiting.get(name, 0) if rates else 0:>9}"
                f"{_ms(ttft.p99 if ttft else None):>11}"
                f"{_ms(tpot.p99 if tpot else None):>11}"
                f"{rates.class_rates.get(name, 0) if rates else 0:>10,.0f}"
            )
        if interactive:
            print("\033[2J\033[H", end="")
        print("\n".join(lines), flush=True)

    started = time.monotonic()
    interrupted = False
    run = None
    try:
        run = run_policy(
            Policy.QOSD,
            workload,
            gpu=gpu,
            capacity_cost_s=cost_capacity,
            output_weight=output_weight,
            redis_url=config.redis.url,
            drain_s=10.0,
            window_s=duration_s,
            base_config=config,
            on_record=records.append,
            on_tick=tick,
        )
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping the daemon and the simulated server ...", flush=True)
    window = min(duration_s, time.monotonic() - started)
    summary = policy_summary(
        records,
        objectives,
        window_s=max(window, 1.0),
        capacity_tokens_s=capacity,
        busy=run.busy if run is not None else (),
    )
    print(f"\nqosd demo report ({len(records)} requests finished or answered, {MODEL!r} pool)")
    for name in class_names:
        c = summary[name]
        if not c["offered"]:
            attainment = "none offered"
        elif c["slo_attainment"] is None:
            attainment = f"{c['attainment_of_offered']:.1%} of offered served (no SLO)"
        else:
            attainment = (
                f"{c['attainment_of_offered']:.1%} of offered ({c['slo_attainment']:.1%} of "
                "admitted) met SLO"
            )
        reasons = ", ".join(f"{k} {v}" for k, v in Counter(c["reasons"]).most_common()) or "none"
        print(
            f"  {name}: {c['admitted']}/{c['offered']} admitted, {attainment}; TTFT p99 "
            f"{_ms(c['ttft_p99_ms'])}, TPOT p99 {_ms(c['tpot_p99_ms'])}; worst wait "
            f"{c['worst_wait_ms']:,.0f} ms (max {c['max_wait_ms']:,.0f}); not admitted: {reasons}"
        )
    total = summary["all"]
    busy = "n/a" if total["busy_fraction"] is None else f"{total['busy_fraction']:.0%}"
    print(
        f"  goodput {total['goodput_window_tokens_s']:,.0f} tokens/s over the arrival window "
        f"= {total['goodput_of_saturated']:.0%} of the GPU's saturated capacity (work done "
        f"in the drain included; {total['goodput_of_capacity']:.0%} over the "
        f"{total['goodput_span_s']:.0f}s to the last completion); GPU busy {busy}; 32K "
        "prompts admitted "
        f"{total['long_prompts_admitted']}/{total['long_prompts_offered']}"
    )
    if run is not None and run.adjustments:  # not known after Ctrl-C
        print("  SLO loop changes:\n    " + "\n    ".join(run.adjustments[:6]))
    if run is None and records:
        run = PolicyRun(Policy.QOSD, records)
    if run is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for path in plot_runs([run], objectives, Path(out_dir) / "qosd_demo"):
            print(f"  plot: {path}")
    print("\nCompare with no QoS and static buckets: python benchmarks/qos_replay.py --json r.json")
    return 130 if interrupted else 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"
