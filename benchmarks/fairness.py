"""Fair shares by tokens within a class, measured: one tenant floods P1.

    python benchmarks/fairness.py --json docs/results/fairness.json

Ten P1 tenants send requests to the simulated server through two qosd daemons on one
Redis (the benchmark starts it): one tenant offers ten times the load of each of the
other nine, and together they offer ``--load`` (2 by default) times what the GPU
serves of this mix. Prompt and output lengths are drawn from the Azure conversation
trace; arrivals are Poisson. Three configurations of the same daemons run the same
requests in one run:

- ``vtc``: P1 shares by tokens among its tenants (``classes.P1.fairness: vtc``);
- ``fifo``: P1's waiters by due time, first come first served;
- ``ceilings``: FIFO, with each tenant capped at a tenth of the pool
  (``tenant_max_share: 0.1``).

Everything else is qosd as ``benchmarks/qos_replay.py`` configures it (a GPU-gated pool
at the load test's capacity, the SLO loop on). For each configuration and seed:

- each tenant's service: ``input_weight x prompt + output_weight x output`` tokens of
  the requests it completed within the span (the paper's measure, w_p 1 and w_q 2),
  and its plain tokens;
- Jain's fairness index of the services over the backlogged tenants (every tenant
  here offers more than a tenth of what the GPU serves);
- the largest service difference between two backlogged tenants over the run, and
  the paper's bound for it: twice the largest charge of one request,
  ``2 x (w_p x the longest prompt + w_q x the longest output)`` (the bound holds for
  the order requests are admitted in; a GPU serves many at once, so what completes
  lags that order);
- the light tenants' P1 attainment of offered (the benchmark's objectives,
  ``qosd_sim.objectives``);
- goodput: tokens of requests that met their objectives over the span.

It writes ``policies.{vtc,fifo,ceilings}`` (the mean of seeds, the worst beside it in
``worst``) and ``per_seed``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qosd_harness import redis_server, source_commit
from qosd_sim.experiment import (
    CapacityChoice,
    Policy,
    PolicyRun,
    configured_capacity,
    run_policy,
    workload_capacity,
)
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import SCALED
from qosd_sim.replay import Request, read_trace
from qosd_sim.results import met, span_end

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"
HEAVY = "heavy"
INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0  # the paper's w_p and w_q, qosd's defaults
CONFIGS: dict[str, dict[str, Any]] = {
    "vtc": {"fairness": "vtc"},
    "fifo": {},
    "ceilings": {"tenant_max_share": 0.1},
}


def tenants(count: int) -> list[str]:
    return [HEAVY, *(f"light-{n}" for n in range(1, count))]


def workload(
    rows: list[tuple[int, int]], rate_s: float, duration_s: float, heavy_x: float, count: int,
    seed: int,
) -> list[Request]:  # fmt: skip
    """Poisson arrivals per tenant: the heavy one at ``heavy_x`` times each light one's
    rate, ``rate_s`` requests a second in all; lengths drawn from ``rows``."""
    rng = random.Random(seed)
    shares = {name: (heavy_x if name == HEAVY else 1.0) for name in tenants(count)}
    total = sum(shares.values())
    arrivals: list[tuple[float, str]] = []
    for name, share in shares.items():
        t = rng.expovariate(rate_s * share / total)
        while t < duration_s:
            arrivals.append((t, name))
            t += rng.expovariate(rate_s * share / total)
    arrivals.sort()
    out = []
    for index, (at_s, name) in enumerate(arrivals):
        prompt, output = rows[rng.randrange(len(rows))]
        out.append(Request(index, at_s, prompt, output, "P1", name))
    return out


def service(request: Request, output_tokens: int) -> float:
    return INPUT_WEIGHT * request.input_tokens + OUTPUT_WEIGHT * output_tokens


def jain(values: list[float]) -> float:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has everything."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def evaluate(run: PolicyRun, names: list[str], duration_s: float) -> dict[str, Any]:
    span = span_end(run.records, duration_s, run.duration_s)
    served = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    light_offered = light_met = 0
    good = 0
    for record in run.records:
        request = record.request
        on_time = met(record, SCALED["P1"])
        if record.completed:
            served[request.tenant] += service(request, record.tokens_seen)
            tokens[request.tenant] += request.input_tokens + record.tokens_seen
        if on_time:
            good += request.tokens()
        if request.tenant != HEAVY:
            light_offered += 1
            light_met += on_time
    values = [served[name] for name in names]
    longest = max(service(r.request, r.request.output_tokens) for r in run.records)
    return {
        "span_s": round(span, 1),
        "served_service": {name: round(v / span, 1) for name, v in served.items()},
        "served_tokens_s": {name: round(t / span, 1) for name, t in tokens.items()},
        "jain_index": round(jain(values), 4),
        "max_service_difference_tokens": round(max(values) - min(values), 1),
        "bound_tokens": round(2 * longest, 1),
        "light_tenants_attainment_of_offered": round(light_met / light_offered, 4),
        "goodput_tokens_s": round(good / span, 1),
        "heavy_share_of_service": round(served[HEAVY] / sum(values), 4) if any(values) else 0.0,
    }


def overrides_for(name: str) -> Callable[[dict[str, Any]], None]:
    def apply(tree: dict[str, Any]) -> None:
        tree["classes"]["P1"].update(CONFIGS[name])

    return apply


def summarise(per_seed: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = ("jain_index", "light_tenants_attainment_of_offered", "goodput_tokens_s",
            "max_service_difference_tokens", "bound_tokens", "heavy_share_of_service")  # fmt: skip
    worse_high = {"max_service_difference_tokens", "heavy_share_of_service"}
    mean: dict[str, Any] = {}
    worst: dict[str, Any] = {}
    for name in CONFIGS:
        runs = [seed["policies"][name] for seed in per_seed]
        mean[name] = {k: round(statistics.fmean(r[k] for r in runs), 4) for k in keys}
        worst[name] = {k: (max if k in worse_high else min)(r[k] for r in runs) for k in keys}
    return mean, worst


def markdown(mean: dict[str, Any], worst: dict[str, Any]) -> str:
    lines = [
        "| configuration | Jain's index (worst) | light tenants' P1 attainment (worst) "
        "| goodput tokens/s (worst) | heavy tenant's share of service | largest service "
        "difference / bound |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in mean.items():
        w = worst[name]
        lines.append(
            f"| {name} | {m['jain_index']:.3f} ({w['jain_index']:.3f}) "
            f"| {m['light_tenants_attainment_of_offered']:.1%} "
            f"({w['light_tenants_attainment_of_offered']:.1%}) "
            f"| {m['goodput_tokens_s']:,.0f} ({w['goodput_tokens_s']:,.0f}) "
            f"| {m['heavy_share_of_service']:.1%} "
            f"| {m['max_service_difference_tokens']:,.0f} / {m['bound_tokens']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE) if DEFAULT_TRACE.exists() else None,
        help="prompt and output lengths come from here (default: the Azure conversation "
        "trace, else the bundled sample)",
    )
    parser.add_argument("--load", type=float, default=2.0, help="offered / what the GPU serves")
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--heavy-x", type=float, default=10.0, help="heavy / each light tenant")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--drain", type=float, default=20.0)
    parser.add_argument("--seeds", default="11,12", help="comma-separated")
    parser.add_argument("--daemons", type=int, default=2, help="qosd daemons on one Redis")
    parser.add_argument("--json", default="fairness.json")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    gpu = GpuModel()
    rows = [(row.input_tokens, row.output_tokens) for row in read_trace(args.trace)]
    output_weight = 1.0
    pool = configured_capacity(gpu, output_weight, SCALED["P0"], choice=CapacityChoice.SLO)
    names = tenants(args.tenants)
    per_seed = []
    for seed in (int(s) for s in args.seeds.split(",")):
        probe = workload(rows, 1.0, 600.0, args.heavy_x, args.tenants, seed)
        capacity = workload_capacity(gpu, probe, 1.0)  # tokens a second the GPU serves
        mean_tokens = statistics.fmean(r.tokens() for r in probe)
        rate = args.load * capacity / mean_tokens
        requests = workload(rows, rate, args.duration, args.heavy_x, args.tenants, seed)
        print(f"seed {seed}: {len(requests)} requests in {args.duration:.0f}s, "
              f"{rate:.1f}/s, GPU {capacity:,.0f} tokens/s on this mix", flush=True)  # fmt: skip
        policies = {}
        for name in CONFIGS:
            started = time.monotonic()
            with redis_server() as redis:
                run = run_policy(
                    Policy.QOSD, requests, gpu=gpu, capacity_cost_s=pool.cost_s,
                    output_weight=output_weight, redis_url=redis.url, drain_s=args.drain,
                    window_s=args.duration, config_overrides=overrides_for(name),
                    daemons=args.daemons,
                )  # fmt: skip
            policies[name] = evaluate(run, names, args.duration)
            print(f"  {name}: ran in {time.monotonic() - started:.0f}s: "
                  f"{json.dumps({k: v for k, v in policies[name].items() if 'served' not in k})}",
                  flush=True)  # fmt: skip
        per_seed.append({"seed": seed, "requests": len(requests), "policies": policies})
    mean, worst = summarise(per_seed)
    results = {
        "command": "benchmarks/fairness.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "commit": source_commit(Path(__file__).resolve().parents[1]),
        "gpu": gpu.engine,
        "pool_capacity_cost_s": round(pool.cost_s, 1),
        "tenants": names,
        "policies": mean,
        "worst": worst,
        "per_seed": per_seed,
    }
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(mean, worst)
    Path(args.json).with_suffix(".md").write_text(table)
    print(table, end="")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
