"""Worker scaling: Acquire throughput of ``qosd serve --workers N`` for several N,
side by side in one run, on one Redis.

    python benchmarks/workers.py --json results/workers.json            # N = 1, 2, ...
    python benchmarks/workers.py --workers 1,2,4,8 --json results/workers.json

One daemon group (a supervisor and its N workers; N = 1 is a plain daemon) per N is
started at once, all on the same redis-server and pool; the rounds alternate between
them, and the median round is reported. Load comes from h2load with prebuilt gRPC
frames, ``--clients-per-worker`` connections per worker (SO_REUSEPORT spreads
connections, not calls, over the workers) of ``--streams`` streams each.

The default N are the powers of two up to the CPUs left after one for Redis and one
for the load generator (at least 1 and 2), so the same command runs N = 1, 2, 4, 8 on a
16-CPU machine. Two modes:

- pinned: the group with N workers on N CPUs of its own, redis-server on one more,
  h2load (with a thread per CPU) on the rest, when the machine has N + 2 CPUs for the
  largest N; with fewer, the daemons share the CPUs Redis and h2load leave them (on a
  2-CPU machine: every group on CPU 0, Redis and h2load on CPU 1);
- shared: nothing pinned.

Each round is metered as in decisions.py: CPU and RSS summed over the supervisor and
every worker, Redis's time per Acquire and its CPU, and what other processes used.
The scaling efficiency is rps(N) / (N x rps(1)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from qosd_client.v1 import qosd_pb2
from qosd_harness import daemon_processes, redis_server

if __package__ in (None, ""):  # run as a script: python benchmarks/workers.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decisions import (
    ACQUIRE_PATH,
    Meter,
    check_one_acquire,
    count_leases,
    grpc_frame,
    h2load_command,
    memory_kb,
    process_tree,
    round_costs,
    run_loads,
    set_affinity,
    summarise_costs,
)


def default_workers() -> list[int]:
    usable = max(2, len(os.sched_getaffinity(0)) - 2)
    counts, n = [], 1
    while n <= usable:
        counts.append(n)
        n *= 2
    return counts


@dataclass(frozen=True)
class Layout:
    """Which CPUs the daemons, redis-server and h2load get; None: not pinned."""

    daemon: list[int] | None
    redis: list[int] | None
    load: list[int] | None
    note: str

    def daemon_cpus(self, workers: int) -> set[int] | None:
        if self.daemon is None:
            return None
        return set(self.daemon[: min(workers, len(self.daemon))])


def plan(mode: str, cpus: list[int], largest: int) -> Layout:
    if mode == "shared" or len(cpus) < 2:
        return Layout(None, None, None, f"nothing pinned: everything shares CPUs {cpus}")
    if len(cpus) >= largest + 2:
        daemon, redis_cpu, load = cpus[:largest], cpus[largest : largest + 1], cpus[largest + 1 :]
        return Layout(
            daemon, redis_cpu, load,
            f"N workers on CPUs {daemon}[:N], redis-server on {redis_cpu}, h2load on {load}",
        )  # fmt: skip
    daemon, rest = cpus[:-1], cpus[-1:]
    return Layout(
        daemon, rest, rest,
        f"too few CPUs for {largest} workers apart: every group on CPUs {daemon} (N workers "
        f"on the first min(N, {len(daemon)})), redis-server and h2load on {rest}",
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=default_workers(),
        help="comma-separated worker counts (default: %(default)s here)",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per N")
    parser.add_argument("--clients-per-worker", type=int, default=4, help="h2load connections")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams each")
    parser.add_argument("--modes", default="pinned,shared", help="pinned, shared or both")
    args = parser.parse_args()
    if shutil.which("h2load") is None:
        print("h2load is required: apt-get install nghttp2-client", file=sys.stderr)
        return 2
    counts: list[int] = sorted(set(args.workers))
    modes = [mode.strip() for mode in args.modes.split(",")]
    all_cpus = sorted(os.sched_getaffinity(0))

    with redis_server() as server, tempfile.TemporaryDirectory() as scratch:
        assert server.process is not None
        base = {
            "redis": {"url": server.url, "key_prefix": "bench"},
            "pools": {"default": {"capacity_tokens_s": 1e9}},
        }
        request = qosd_pb2.AcquireRequest(
            tenant="bench", model="default", qos_class="P1",
            input_tokens=100, expected_output_tokens=50, max_wait_ms=0,
        )  # fmt: skip
        body = Path(scratch, "acquire.bin")
        body.write_bytes(grpc_frame(request.SerializeToString()))
        groups: dict[int, Any] = {}
        with contextlib.ExitStack() as stack:
            for n in counts:
                config = {**base, "server": {"workers": n}}
                (daemon,) = stack.enter_context(daemon_processes(config))
                assert daemon.process is not None
                check_one_acquire(daemon.address, request)
                pids = process_tree(daemon.process.pid)
                groups[n] = {
                    "daemon": daemon,
                    "processes": len(pids),
                    "rss_at_rest_mb": memory_kb(pids, "VmRSS") / 1024,
                }
                print(
                    f"N={n}: {len(pids)} processes on {daemon.address}, "
                    f"{groups[n]['rss_at_rest_mb']:.0f} MB at rest"
                )
            results: dict[str, Any] = {}
            acquired = 0.0
            for mode in modes:
                layout = plan(mode, all_cpus, max(counts))
                rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
                for n in counts:
                    pin = layout.daemon_cpus(n)
                    set_affinity(groups[n]["daemon"].process.pid, pin or set(all_cpus))
                set_affinity(server.process.pid, set(layout.redis or all_cpus))
                os.sched_setaffinity(0, set(layout.load or all_cpus))  # h2load inherits it
                threads = max(1, len(layout.load or []) or len(all_cpus) - max(counts) - 1)
                try:
                    for round_index in range(args.rounds):
                        for n in counts:
                            daemon = groups[n]["daemon"]
                            clients = args.clients_per_worker * n
                            command = h2load_command(
                                daemon.address, ACQUIRE_PATH, body, clients=clients,
                                streams=args.streams, seconds=args.seconds,
                                threads=min(clients, threads),
                            )  # fmt: skip
                            meter = Meter(
                                daemons=[daemon.process.pid],
                                redis_ports=[server.port],
                                redis_pids=[server.process.pid],
                                probe=lambda: count_leases(server.url),
                            )
                            (figures,), window = run_loads([command], meter)
                            figures_any: dict[str, Any] = {**figures, "window": window}
                            rounds[n].append(figures_any)
                            acquired += figures["succeeded"]
                            costs = round_costs(figures_any)
                            print(
                                f"[{mode}] round {round_index + 1} N={n}: "
                                f"{figures['rps']:8.0f} Acquire/s; daemons "
                                f"{costs['daemon_cpus_busy']:.2f} CPUs, "
                                f"{costs['daemon_cpu_ms_per_1000']:.0f} CPU-ms/1000, RSS "
                                f"{costs['daemon_rss_peak_mb']:.0f} MB; Redis "
                                f"{costs['redis_cpus_busy']:.2f} CPUs, "
                                f"{costs['redis_us_per_request']:.1f} µs/Acquire, "
                                f"{costs['requests_per_evalsha']:.1f}/EVALSHA; others "
                                f"{costs['others_cpu_s']:.2f} CPU-s"
                            )
                finally:
                    os.sched_setaffinity(0, set(all_cpus))
                results[mode] = summarise_mode(rounds, groups, layout, threads)
            leases = count_leases(server.url)

    out: dict[str, Any] = {
        **results,
        "leases_created": leases,
        "setup": {
            "workers": counts,
            "processes": {str(n): groups[n]["processes"] for n in counts},
            "clients_per_worker": args.clients_per_worker,
            "streams_per_client": args.streams,
            "seconds_per_round": args.seconds,
            "rounds": args.rounds,
            "cpus": len(all_cpus),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
        },
    }
    print_table(out, modes, counts)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if leases < acquired:
        print(f"error: {acquired:.0f} Acquires answered but only {leases} leases exist",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def summarise_mode(
    rounds: dict[int, list[dict[str, Any]]],
    groups: dict[int, Any],
    layout: Layout,
    threads: int,
) -> dict[str, Any]:
    base = statistics.median(r["rps"] for r in rounds[min(rounds)])
    per_n: dict[str, Any] = {}
    for n, measured in rounds.items():
        rps = statistics.median(r["rps"] for r in measured)
        costs = summarise_costs(measured)
        per_n[str(n)] = {
            "acquire_rps": rps,
            "scaling_efficiency": rps / (n * base) if min(rounds) == 1 else None,
            "vs_one_worker": rps / base,
            "daemon_cpus": sorted(layout.daemon_cpus(n) or []) or "all",
            "processes": groups[n]["processes"],
            "sizing": {
                "cpu_ms_per_1000": costs["daemon_cpu_ms_per_1000"],
                "cpus_busy": costs["daemon_cpus_busy"],
                "rss_at_rest_mb": groups[n]["rss_at_rest_mb"],
                "rss_under_load_peak_mb": costs["daemon_rss_peak_mb"],
                "vm_hwm_mb": costs["daemon_hwm_mb"],
            },
            "redis_us_per_acquire": costs["redis_us_per_request"],
            "redis_cpu_us_per_acquire": costs["redis_cpu_us_per_request"],
            "redis_cpus_busy": costs["redis_cpus_busy"],
            "machine_cpus_busy": costs["machine_cpus_busy"],
            "acquires_per_evalsha": costs["requests_per_evalsha"],
            "others_cpu_s_max": costs["others_cpu_s_max"],
            "rounds": [
                {"rps": r["rps"], "succeeded": r["succeeded"], **r["window"]} for r in measured
            ],
        }
    return {"layout": layout.note, "h2load_threads": threads, "by_workers": per_n}


def print_table(out: dict[str, Any], modes: list[str], counts: list[int]) -> None:
    print()
    print("mode    N  Acquire/s  efficiency  daemon CPUs  CPU-ms/1000  RSS rest/peak MB  "
          "Redis CPUs  Redis µs/Acq  machine CPUs  others CPU-s")  # fmt: skip
    for mode in modes:
        for n in counts:
            row = out[mode]["by_workers"][str(n)]
            efficiency = row["scaling_efficiency"]
            sizing = row["sizing"]
            print(
                f"{mode:7s} {n:2d} {row['acquire_rps']:10.0f}  "
                f"{efficiency if efficiency is not None else float('nan'):10.2f}  "
                f"{sizing['cpus_busy']:11.2f}  {sizing['cpu_ms_per_1000']:11.0f}  "
                f"{sizing['rss_at_rest_mb']:7.0f} / {sizing['rss_under_load_peak_mb']:4.0f}     "
                f"{row['redis_cpus_busy']:10.2f}  {row['redis_us_per_acquire']:12.1f}  "
                f"{row['machine_cpus_busy']:12.2f}  "
                f"{row['others_cpu_s_max']:.2f}"
            )
        print(f"  {mode}: {out[mode]['layout']}; h2load threads {out[mode]['h2load_threads']}")


if __name__ == "__main__":
    raise SystemExit(main())
