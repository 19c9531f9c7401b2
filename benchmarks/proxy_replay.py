"""QoS with no gateway code: the 2x replay through qosd's proxy, through LiteLLM's, and
straight to the server, side by side.

    python -m benchmarks.proxy_replay --trace ../shared/traces/azure2023_conv.csv \
        --json docs/results/proxy_replay.json

The Azure conversation trace at ``--load`` (2) times what the simulated GPU (the
A100 cost model, chunked prefill, FCFS as vLLM schedules by default) serves of it,
classes P0 20 %, P1 50 %, P2 30 % by a seeded hash, and a 32K-token P1 prompt every
10 s: the QoS benchmark's workload (``benchmarks/qos_replay.py``), over ``--duration``
seconds. Every request is a streaming chat completion sent with the official
``openai`` async client to one of:

- ``none``: ``qosd sim-vllm`` directly;
- ``qosd``: ``qosd proxy`` in front of it, configured as the QoS benchmark configures
  qosd (the pool's capacity from a load test, the server's own limits, the SLO loop
  on), with Redis as its store; the class in ``x-qos-class``;
- ``litellm``: LiteLLM's proxy (PyPI, its own venv) in front of it, configured with
  what it offers openly: the deployment's ``tpm`` at the same load test's capacity
  in its units (``litellm_tpm``), tracked in the same Redis
  (``usage-based-routing-v2`` with ``enable_pre_call_checks``), and its priority
  scheduling, each request carrying its class's rank in ``priority``.

Each run has a fresh server. Requests are scored by the benchmark's objectives
(``qosd_sim.objectives``, the scaled TTFT), never by a proxy's config: P0 on time
and P1 attained over offered, and goodput (tokens of requests that met their
objectives over the span). Seeds 11, 12 and 13 by default; the mean and the worst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.litellm_peer import MASTER_KEY, litellm_proxy, model_entry, version
from qosd_harness import redis_server, source_commit
from qosd_sim.experiment import (
    MODEL,
    CapacityChoice,
    Policy,
    PolicyRun,
    configured_capacity,
    daemon_config,
)
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import CLASSES, SCORINGS
from qosd_sim.openai_experiment import proxy_process, replay_openai, vllm_process
from qosd_sim.openai_gateway import rank_priorities
from qosd_sim.replay import read_trace
from qosd_sim.results import RunSamples, policy_summary
from qosd_sim.seeds import REPORTED_SEEDS
from qosd_sim.workload import WorkloadSpec, seeded_workload

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023_conv.csv"
TARGETS = ("none", "qosd", "litellm")
OUTPUT_WEIGHT = 4.0  # as the QoS benchmark prices output


def litellm_config(upstream: str, tpm: int, redis_port: int) -> dict[str, Any]:
    return {
        "model_list": [model_entry(MODEL, upstream, tpm=tpm)],
        "router_settings": {
            "routing_strategy": "usage-based-routing-v2",
            "enable_pre_call_checks": True,  # without it the limit is reported, not kept
            "redis_host": "127.0.0.1",
            "redis_port": redis_port,
        },
        "litellm_settings": {"drop_params": True},
    }


def run(
    target: str, workload: Any, args: argparse.Namespace, scratch: Path, redis: Any,
    pool_cost_s: float,
) -> dict[str, Any]:  # fmt: skip
    directory = scratch / target
    directory.mkdir(parents=True, exist_ok=True)
    gpu = GpuModel()

    def replay(policy: Policy, url: str, **options: Any) -> PolicyRun:
        return asyncio.run(
            replay_openai(policy, workload.requests, url=url, metrics_url=f"{upstream}/metrics",
                          drain_s=args.drain, window_s=args.duration, **options)
        )  # fmt: skip

    with vllm_process(gpu, directory) as upstream:
        if target == "none":
            run = replay(Policy.FIFO, f"{upstream}/v1", qosd_address=None, priorities=None)
        elif target == "qosd":
            config = daemon_config(
                Policy.QOSD,
                capacity_cost_s=pool_cost_s,
                output_weight=OUTPUT_WEIGHT,
                redis_url=redis.url,
                gpu=gpu,
            )
            config["redis"]["key_prefix"] += f"-{time.monotonic_ns()}"
            with proxy_process(config, upstream, directory, priority_upstreams=False) as (
                url,
                grpc,
            ):
                run = replay(Policy.QOSD, url, qosd_address=grpc, priorities=None)
        else:
            config = litellm_config(upstream, litellm_tpm(gpu), redis.port)
            with litellm_proxy(args.litellm_venv, config, directory) as (url, _):
                run = replay(Policy.FIFO, f"{url}/v1", qosd_address=None, api_key=MASTER_KEY,
                             priorities=rank_priorities(list(CLASSES)))  # fmt: skip
    return summarise(run, workload, args)


def summarise(run: PolicyRun, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    summary = policy_summary(
        run.records, SCORINGS["scaled"], RunSamples(end_s=run.duration_s, busy=run.busy),
        window_s=args.duration, capacity_tokens_s=workload.trace_capacity_tokens_s,
    )  # fmt: skip
    return {
        "p0_on_time": summary["P0"]["attainment_of_offered"],
        "p1_attained_of_offered": summary["P1"]["attainment_of_offered"],
        "goodput_tokens_s": summary["all"]["goodput_tokens_s"],
        "goodput_of_saturated": summary["all"]["goodput_span_of_saturated"],
        "busy_fraction": summary["all"]["busy_fraction"],
        "classes": {name: summary[name] for name in CLASSES},
        "errors": sum(1 for r in run.records if r.error and "unfinished" not in r.error),
    }


def litellm_tpm(gpu: GpuModel) -> int:
    """LiteLLM's tokens-per-minute limit: the same load test's capacity as qosd's pool,
    in LiteLLM's unit (prompt plus output tokens; qosd's prices output at 4)."""
    plain = configured_capacity(gpu, 1.0, SCORINGS["scaled"]["P0"], choice=CapacityChoice.SLO)
    return round(plain.cost_s * 60)


KEYS = ("p0_on_time", "p1_attained_of_offered", "goodput_tokens_s", "goodput_of_saturated")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--load", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--drain", type=float, default=30.0)
    parser.add_argument("--seeds", default=",".join(map(str, REPORTED_SEEDS)))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--litellm-venv", type=Path,
                        default=Path(tempfile.gettempdir()) / "litellm-venv")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    targets = args.targets.split(",")
    gpu = GpuModel()
    rows = read_trace(args.trace if args.trace.exists() else None)
    pool = configured_capacity(gpu, OUTPUT_WEIGHT, SCORINGS["scaled"]["P0"],
                               choice=CapacityChoice.SLO)  # fmt: skip
    spec = WorkloadSpec(load=args.load, duration_s=args.duration)
    per_seed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch, redis_server() as redis:
        for seed in (int(s) for s in args.seeds.split(",")):
            workload = seeded_workload(rows, gpu, spec, seed)
            print(f"seed {seed}: {len(workload.requests)} requests", flush=True)
            results = {}
            for target in targets:
                results[target] = run(target, workload, args, Path(scratch), redis, pool.cost_s)
                shown = {k: results[target][k] for k in KEYS}
                print(f"  {target}: {shown} errors {results[target]['errors']}", flush=True)
            per_seed.append({"seed": seed, "targets": results})
    mean = {t: {k: round(statistics.fmean(s["targets"][t][k] for s in per_seed), 4)
                for k in KEYS} for t in targets}  # fmt: skip
    worst = {t: {k: min(s["targets"][t][k] for s in per_seed) for k in KEYS} for t in targets}
    result = {
        "targets": mean,
        "worst": worst,
        "per_seed": per_seed,
        "pool_capacity_cost_s": round(pool.cost_s, 1),
        "litellm_tpm": litellm_tpm(gpu),
        "litellm_version": version(args.litellm_venv) if "litellm" in targets else None,
        "trace": args.trace.name if args.trace.exists() else "bundled sample",
        "commit": source_commit(Path(__file__).resolve().parents[1]),
        "command": f"python -m benchmarks.proxy_replay --load {args.load} --duration "
        f"{args.duration} --seeds {args.seeds}",
    }
    print(json.dumps({"targets": mean, "worst": worst}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
