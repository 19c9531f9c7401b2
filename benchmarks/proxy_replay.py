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

``--targets`` (or ``--policies``) picks which run, in order, from those three and:

- ``static``: ``qosd proxy`` configured as for ``qosd`` but as the static policy
  configures the daemon (token buckets and the gate, no SLO loop);
- ``qosd-count``: ``qosd`` with the proxy routing by requests in flight
  (``--route in-flight``) rather than by predicted time to first token (the default,
  ``predicted``): it matters with several servers (``--upstreams``);
- ``qosd-one-clock``: ``qosd`` with the pool's ``servers`` set to 1 whatever
  ``--upstreams`` says: the stores predict every prompt's start behind all the prefill
  admitted, as if one server took it all (how qosd predicted before it counted
  servers).

Several servers of one model, ``--upstreams N`` (1 by default, the runs above):

- N ``qosd sim-vllm`` servers, each its own process, port and GPU of the same model;
- the load scales with them: ``--load`` stays offered load over capacity, capacity
  being the N servers' together, so the trace is compressed to ``load`` x N times
  one server's capacity on it (``WorkloadSpec.load``, which ``calibrated_workload``
  states against one GPU), and the 32K-token prompt comes every ``--inject-every``/N
  seconds: the same cadence per server, N times as many. Goodput "of saturated" is
  over N servers' saturated throughput, and the busy fraction is the servers' mean;
- ``qosd``, ``qosd-count`` and ``static``: one proxy with N ``--upstream MODEL=URL``,
  the pool's capacity, ``max_in_flight`` and ``max_in_flight_tokens`` N times one
  server's (they are the pool's, summed over its servers), and ``servers: N``;
- ``none``: the client sends each request to the next server in turn, as a plain
  Kubernetes Service in front of them does (there is no proxy);
- ``litellm``: N deployments of the model (one ``model_name``, each its
  ``api_base``), each with one server's ``tpm``.

The results' header records ``upstreams``; ``pool_capacity_cost_s`` is the pool's
(N servers'), ``litellm_tpm`` one deployment's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.litellm_peer import MASTER_KEY, litellm_proxy, model_entry, version
from benchmarks.qos_replay import RECORD_FIELDS
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
TARGETS = ("none", "qosd", "litellm")  # the default run
KNOWN_TARGETS = (*TARGETS, "static", "qosd-count", "qosd-one-clock")
#: How each target's proxy routes over several servers (``qosd proxy --route``).
PROXY_ROUTES = {"qosd": None, "static": None, "qosd-count": "in-flight", "qosd-one-clock": None}
OUTPUT_WEIGHT = 4.0  # as the QoS benchmark prices output


def litellm_config(upstreams: list[str], tpm: int, redis_port: int) -> dict[str, Any]:
    """One deployment of the model per server (one ``model_name``), each at ``tpm``."""
    return {
        "model_list": [model_entry(MODEL, upstream, tpm=tpm) for upstream in upstreams],
        "router_settings": {
            "routing_strategy": "usage-based-routing-v2",
            "enable_pre_call_checks": True,  # without it the limit is reported, not kept
            "redis_host": "127.0.0.1",
            "redis_port": redis_port,
        },
        "litellm_settings": {"drop_params": True},
    }


def qosd_config(
    target: str, redis: Any, gpu: GpuModel, pool_cost_s: float, servers: int
) -> dict[str, Any]:
    """The daemon's config for ``qosd``, ``qosd-count`` or ``static``: the pool's
    capacity and in-flight bounds are its ``servers``' together."""

    def pool_of_servers(tree: dict[str, Any]) -> None:
        pool = tree["pools"][MODEL]
        pool["max_in_flight"] *= servers
        pool["max_in_flight_tokens"] *= servers
        # pools.<pool>.servers: how many servers the proxy spreads the pool over.
        pool["servers"] = 1 if target == "qosd-one-clock" else servers

    config = daemon_config(
        Policy.STATIC if target == "static" else Policy.QOSD,
        capacity_cost_s=pool_cost_s * servers,
        output_weight=OUTPUT_WEIGHT,
        redis_url=redis.url,
        gpu=gpu,
        overrides=pool_of_servers if servers > 1 else None,
    )
    config["redis"]["key_prefix"] += f"-{time.monotonic_ns()}"
    return config


def run(
    target: str, workload: Any, args: argparse.Namespace, scratch: Path, redis: Any,
    pool_cost_s: float,
) -> dict[str, Any]:  # fmt: skip
    directory = scratch / target
    directory.mkdir(parents=True, exist_ok=True)
    gpu = GpuModel()
    n = args.upstreams

    with contextlib.ExitStack() as servers:
        upstreams = [
            servers.enter_context(vllm_process(gpu, directory, "vllm" if n == 1 else f"vllm{i}"))
            for i in range(n)
        ]

        def replay(policy: Policy, url: str | list[str], **options: Any) -> PolicyRun:
            return asyncio.run(
                replay_openai(policy, workload.requests, url=url,
                              metrics_url=[f"{u}/metrics" for u in upstreams],
                              drain_s=args.drain, window_s=args.duration, **options)
            )  # fmt: skip

        if target == "none":
            direct = [f"{u}/v1" for u in upstreams]
            run = replay(Policy.FIFO, direct, qosd_address=None, priorities=None)
        elif target in PROXY_ROUTES:
            config = qosd_config(target, redis, gpu, pool_cost_s, n)
            route = PROXY_ROUTES[target]
            extra = ["--route", route] if route else []
            with proxy_process(
                config, upstreams, directory, priority_upstreams=False, extra_args=extra
            ) as (url, grpc):
                policy = Policy.STATIC if target == "static" else Policy.QOSD
                run = replay(policy, url, qosd_address=grpc, priorities=None)
        else:
            config = litellm_config(upstreams, litellm_tpm(gpu), redis.port)
            with litellm_proxy(args.litellm_venv, config, directory) as (url, _):
                run = replay(Policy.FIFO, f"{url}/v1", qosd_address=None, api_key=MASTER_KEY,
                             priorities=rank_priorities(list(CLASSES)))  # fmt: skip
    summary = summarise(run, workload, args)
    if args.records:
        summary["records"] = [
            [*dataclasses.astuple(r.request), *(getattr(r, f) for f in RECORD_FIELDS)]
            for r in run.records
        ]
    return summary


def summarise(run: PolicyRun, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    summary = policy_summary(
        run.records, SCORINGS["scaled"], RunSamples(end_s=run.duration_s, busy=run.busy),
        window_s=args.duration,
        capacity_tokens_s=workload.trace_capacity_tokens_s * args.upstreams,
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--load", type=float, default=2.0, help="offered load over all --upstreams' capacity"
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--drain", type=float, default=30.0)
    parser.add_argument("--seeds", default=",".join(map(str, REPORTED_SEEDS)))
    parser.add_argument("--targets", "--policies", dest="targets", default=",".join(TARGETS),
                        help=f"comma-separated, of {', '.join(KNOWN_TARGETS)}")  # fmt: skip
    parser.add_argument("--upstreams", type=int, default=1,
                        help="servers of the model, each its own simulated GPU")  # fmt: skip
    parser.add_argument("--inject-every", type=float, default=10.0,
                        help="seconds between 32K-token prompts, per server")  # fmt: skip
    parser.add_argument("--litellm-venv", type=Path,
                        default=Path(tempfile.gettempdir()) / "litellm-venv")  # fmt: skip
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--records", type=Path, metavar="FILE",
        help="also write every request's record, per seed and target, as gzipped JSON "
        "(the QoS benchmark's record fields), to see where a target lost what it lost",
    )  # fmt: skip
    args = parser.parse_args()
    unknown = set(args.targets.split(",")) - set(KNOWN_TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}: pick from {', '.join(KNOWN_TARGETS)}")
    if args.upstreams < 1:
        parser.error("--upstreams takes 1 or more")
    return args


def command_line(args: argparse.Namespace) -> str:
    """The run's command, as the results record it (as before for one server)."""
    line = (
        f"python -m benchmarks.proxy_replay --load {args.load} --duration "
        f"{args.duration} --seeds {args.seeds}"
    )
    if args.upstreams > 1:
        line += f" --upstreams {args.upstreams} --targets {args.targets}"
    if args.inject_every != 10.0:
        line += f" --inject-every {args.inject_every}"
    return line


def main() -> int:
    args = parse_args()
    targets = args.targets.split(",")
    n = args.upstreams
    gpu = GpuModel()
    rows = read_trace(args.trace if args.trace.exists() else None)
    pool = configured_capacity(gpu, OUTPUT_WEIGHT, SCORINGS["scaled"]["P0"],
                               choice=CapacityChoice.SLO)  # fmt: skip
    # calibrated_workload states load against one GPU: N servers take N times the load,
    # and the long prompts come N times as often (the same cadence per server).
    spec = WorkloadSpec(load=args.load * n, duration_s=args.duration,
                        inject_every_s=args.inject_every / n)  # fmt: skip
    per_seed: list[dict[str, Any]] = []
    records: dict[str, dict[str, Any]] = {}  # seed -> target -> rows (--records)
    with tempfile.TemporaryDirectory() as scratch, redis_server() as redis:
        for seed in (int(s) for s in args.seeds.split(",")):
            workload = seeded_workload(rows, gpu, spec, seed)
            print(f"seed {seed}: {len(workload.requests)} requests", flush=True)
            results = {}
            for target in targets:
                results[target] = run(target, workload, args, Path(scratch), redis, pool.cost_s)
                if "records" in results[target]:
                    records.setdefault(str(seed), {})[target] = results[target].pop("records")
                shown = {k: results[target][k] for k in KEYS}
                print(f"  {target}: {shown} errors {results[target]['errors']}", flush=True)
            per_seed.append({"seed": seed, "targets": results})
    if args.records:
        with gzip.open(args.records, "wt") as out:
            json.dump(records, out)
    mean = {t: {k: round(statistics.fmean(s["targets"][t][k] for s in per_seed), 4)
                for k in KEYS} for t in targets}  # fmt: skip
    worst = {t: {k: min(s["targets"][t][k] for s in per_seed) for k in KEYS} for t in targets}
    result = {
        "targets": mean,
        "worst": worst,
        "per_seed": per_seed,
        "upstreams": n,
        "pool_capacity_cost_s": round(pool.cost_s * n, 1),
        "litellm_tpm": litellm_tpm(gpu),
        "litellm_version": version(args.litellm_venv) if "litellm" in targets else None,
        "trace": args.trace.name if args.trace.exists() else "bundled sample",
        "commit": source_commit(Path(__file__).resolve().parents[1]),
        "command": command_line(args),
    }
    print(json.dumps({"targets": mean, "worst": worst}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
