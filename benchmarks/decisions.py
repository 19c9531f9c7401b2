"""Decision benchmark: Acquire through the real daemon and a real Redis, side by side
with an empty unary RPC on the same server (the ceiling) and with the ``limits``
library's Redis rate limiter called in-process (what a user might pick instead).

    python benchmarks/decisions.py --json results/decisions.json

Load comes from h2load (Debian package nghttp2-client), a C HTTP/2 load generator,
so the client's own cost does not cap the figures; gRPC frames are prebuilt. Each
figure is measured in rounds that alternate between the subjects, and the median
round is reported, because these machines are shared and noisy. Two phases:

- throughput: many concurrent streams for ``--seconds``; requests per second;
- latency: one stream, one request at a time (uncontended); p50 and p99.

The Acquire requests are all admitted (the pool is sized far above the offered
load), so every call runs the full admission path: a script call that refills,
charges and writes a lease. The run checks that: the leases in Redis must number at
least the Acquires h2load completed (h2load itself cannot see gRPC statuses).

Both phases run twice: "shared", with the daemon, redis-server and h2load sharing
every CPU (on a 2-CPU machine, Redis and the load generator take CPU from the
daemon), and "pinned", with the daemon alone on one CPU, as a sidecar with a CPU
of its own and a remote Redis would run. The top-level figures are the shared ones.

``--tracing`` adds two daemons to the shared run, measured in the same rounds: one
with tracing on and every trace sampled and exported over OTLP (to a receiver in this
process that counts spans), one with tracing on and nothing sampled. The daemon the
other figures come from has tracing off, the default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import redis
import uvloop
from limits import RateLimitItemPerSecond
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from qosd_client.v1 import qosd_pb2
from qosd_sim.harness import OtlpReceiver, daemon_processes, otlp_receiver, redis_server

NOOP_PATH = "/grpc.health.v1.Health/Check"
ACQUIRE_PATH = "/qosd.v1.QoS/Acquire"


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: flag byte 0 (not compressed), 4-byte length."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def run_h2load(
    address: str, path: str, body: Path, *, clients: int, streams: int, seconds: float,
    log_file: Path | None = None,
) -> dict[str, float]:  # fmt: skip
    command = [
        "h2load", "-c", str(clients), "-m", str(streams), "-t", "1",
        "-D", f"{max(1, round(seconds))}", "--warm-up-time", "1",
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        "-d", str(body),
    ]  # fmt: skip
    if log_file is not None:
        command += ["--log-file", str(log_file)]
    command.append(f"http://{address}{path}")
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    result: dict[str, float] = {}
    for line in output.splitlines():
        if line.startswith("finished in"):
            result["rps"] = float(line.split(",")[1].split()[0])
        if line.startswith("requests:"):
            fields = line.replace(",", "").split()
            result["requests"] = float(fields[1])
            result["succeeded"] = float(fields[fields.index("succeeded") - 1])
    if log_file is not None:
        # h2load's log: start time, HTTP status, duration in microseconds.
        durations = sorted(
            int(line.split("\t")[2]) / 1000 for line in log_file.read_text().splitlines() if line
        )
        result["p50_ms"] = percentile(durations, 0.50)
        result["p99_ms"] = percentile(durations, 0.99)
    return result


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def limits_figures(
    redis_url: str, concurrency: int, seconds: float
) -> tuple[float, float, float]:
    """Throughput and uncontended p50/p99 of limits' async Redis limiter, in-process."""

    storage = RedisStorage(f"async+{redis_url}", implementation="redispy")
    limiter = SlidingWindowCounterRateLimiter(storage)
    item = RateLimitItemPerSecond(10**9)
    await limiter.hit(item, "bench", cost=100)  # connect and load scripts
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            await limiter.hit(item, "bench", cost=100)
            count += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    rps = count / (time.perf_counter() - started)
    latencies = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        begin = time.perf_counter()
        await limiter.hit(item, "bench", cost=100)
        latencies.append((time.perf_counter() - begin) * 1000)
    latencies.sort()
    return rps, percentile(latencies, 0.5), percentile(latencies, 0.99)


def median_of(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pins a process and all its threads (gRPC runs C-core threads of its own)."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(thread), cpus)


Subjects = dict[str, tuple[str, str, Path]]  # name: (daemon address, RPC path, request body)


def measure_mode(
    args: argparse.Namespace, subjects: Subjects, scratch: str, tag: str
) -> dict[str, Any]:
    throughput: dict[str, list[dict[str, float]]] = {name: [] for name in subjects}
    latency: dict[str, list[dict[str, float]]] = {name: [] for name in subjects}
    for round_index in range(args.rounds):
        for name, (address, path, body) in subjects.items():
            figures = run_h2load(
                address, path, body, clients=args.clients, streams=args.streams,
                seconds=args.seconds,
            )  # fmt: skip
            throughput[name].append(figures)
            print(f"[{tag}] round {round_index + 1} {name:8s} {figures['rps']:9.0f} req/s")
        for name, (address, path, body) in subjects.items():
            log_file = Path(scratch, f"{tag}-{name}-{round_index}.log")
            figures = run_h2load(
                address, path, body, clients=1, streams=1, seconds=args.latency_seconds,
                log_file=log_file,
            )  # fmt: skip
            latency[name].append(figures)
            print(
                f"[{tag}] round {round_index + 1} {name:8s} p50 {figures['p50_ms']:.3f} ms "
                f"p99 {figures['p99_ms']:.3f} ms (one stream)"
            )
    result: dict[str, Any] = {}
    for name in subjects:
        result[f"{name}_rps"] = median_of(throughput[name], "rps")
        result[f"{name}_p50_ms"] = median_of(latency[name], "p50_ms")
        result[f"{name}_p99_ms"] = median_of(latency[name], "p99_ms")
    result["acquires_completed"] = sum(
        r["succeeded"]
        for name in subjects
        if name.startswith("acquire")
        for r in throughput[name] + latency[name]
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput round")
    parser.add_argument("--latency-seconds", type=float, default=3.0, help="per latency round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per subject")
    parser.add_argument("--clients", type=int, default=4, help="h2load connections")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams each")
    parser.add_argument(
        "--no-pinned", action="store_true", help="skip the run with the daemon on its own CPU"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also measure daemons with tracing on: every trace sampled and exported to "
        "an OTLP receiver, and none sampled (the instrumentation alone)",
    )
    args = parser.parse_args()
    if shutil.which("h2load") is None:
        print("h2load is required: apt-get install nghttp2-client", file=sys.stderr)
        return 2
    all_cpus = os.sched_getaffinity(0)
    pinned = not args.no_pinned and len(all_cpus) >= 2
    daemon_cpu, other_cpus = min(all_cpus), all_cpus - {min(all_cpus)}

    with redis_server() as server, tempfile.TemporaryDirectory() as scratch:
        assert server.process is not None
        config = {
            "redis": {"url": server.url, "key_prefix": "bench"},
            "pools": {"default": {"capacity_tokens_s": 1e9}},
        }
        with (
            daemon_processes(config) as (daemon,),
            traced_daemons(args.tracing, config) as (traced, collector),
        ):
            assert daemon.process is not None
            noop_body = Path(scratch, "noop.bin")
            noop_body.write_bytes(grpc_frame(b""))
            request = qosd_pb2.AcquireRequest(
                tenant="bench", model="default", qos_class="P1",
                input_tokens=100, expected_output_tokens=50, max_wait_ms=0,
            )  # fmt: skip
            acquire_body = Path(scratch, "acquire.bin")
            acquire_body.write_bytes(grpc_frame(request.SerializeToString()))
            check_one_acquire(daemon.address, request)
            subjects: Subjects = {
                "noop": (daemon.address, NOOP_PATH, noop_body),
                "acquire": (daemon.address, ACQUIRE_PATH, acquire_body),
            }
            tracing_subjects: Subjects = {
                f"acquire_{name}": (address, ACQUIRE_PATH, acquire_body)
                for name, address in traced.items()
            }
            for address in traced.values():
                check_one_acquire(address, request)

            shared = measure_mode(args, {**subjects, **tracing_subjects}, scratch, "shared")
            shared_limits = [
                uvloop.run(limits_figures(server.url, args.clients * args.streams, args.seconds))
                for _ in range(args.rounds)
            ]
            pinned_result: dict[str, Any] | None = None
            if pinned:
                set_affinity(daemon.process.pid, {daemon_cpu})
                set_affinity(server.process.pid, other_cpus)
                os.sched_setaffinity(0, other_cpus)  # h2load inherits this
                try:
                    pinned_result = measure_mode(args, subjects, scratch, "pinned")
                finally:
                    os.sched_setaffinity(0, all_cpus)
                    set_affinity(server.process.pid, all_cpus)
            leases = count_leases(server.url)
            spans_exported = collector.received if collector else 0

    results: dict[str, Any] = {key: value for key, value in shared.items()}
    results["limits_rps"] = statistics.median(run[0] for run in shared_limits)
    results["limits_p50_ms"] = statistics.median(run[1] for run in shared_limits)
    results["limits_p99_ms"] = statistics.median(run[2] for run in shared_limits)
    add_ratios(results)
    if args.tracing:
        for name in ("traced", "traced_unsampled"):
            results[f"acquire_{name}_vs_acquire_rps"] = (
                results[f"acquire_{name}_rps"] / results["acquire_rps"]
            )
            results[f"acquire_{name}_vs_acquire_p50"] = (
                results[f"acquire_{name}_p50_ms"] / results["acquire_p50_ms"]
            )
        results["spans_exported"] = spans_exported
    if pinned_result is not None:
        add_ratios(pinned_result)
        results["pinned"] = pinned_result
    acquired = shared["acquires_completed"] + (
        pinned_result["acquires_completed"] if pinned_result else 0
    )
    results["leases_created"] = leases
    results["setup"] = {
        "load_generator": "h2load",
        "clients": args.clients,
        "streams_per_client": args.streams,
        "seconds_per_round": args.seconds,
        "rounds": args.rounds,
        "shared": "daemon, redis-server and h2load share all CPUs",
        "pinned": f"daemon on CPU {daemon_cpu}; redis-server and h2load on {sorted(other_cpus)}",
        "limits_strategy": "SlidingWindowCounterRateLimiter (limits has no token bucket)",
        "limits_concurrency": args.clients * args.streams,
        "cpus": len(all_cpus),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "redis_py": redis.__version__,
    }
    print(json.dumps(results, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if leases < acquired:
        print(f"error: {acquired:.0f} Acquires answered but only {leases} leases exist",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


@contextlib.contextmanager
def traced_daemons(
    wanted: bool, config: dict[str, Any]
) -> Iterator[tuple[dict[str, str], OtlpReceiver | None]]:
    """With ``wanted``: two more daemons on the same Redis, one sampling every trace
    and exporting it to an OTLP receiver in this process, one sampling none, so the
    instrumentation's own cost shows apart from the export's."""
    if not wanted:
        yield {}, None
        return
    with otlp_receiver(keep=False) as (collector, endpoint):
        sampled = {**config, "tracing": {"enabled": True, "endpoint": endpoint}}
        unsampled = {
            **config,
            "tracing": {"enabled": True, "endpoint": endpoint, "sample_ratio": 0},
        }
        with (
            daemon_processes(sampled) as (traced,),
            daemon_processes(unsampled) as (traced_unsampled,),
        ):
            yield (
                {"traced": traced.address, "traced_unsampled": traced_unsampled.address},
                collector,
            )


def add_ratios(results: dict[str, Any]) -> None:
    results["acquire_vs_noop_rps"] = results["acquire_rps"] / results["noop_rps"]
    results["acquire_vs_noop_p50"] = results["acquire_p50_ms"] / results["noop_p50_ms"]
    if "limits_rps" in results:
        results["acquire_vs_limits_rps"] = results["acquire_rps"] / results["limits_rps"]


def check_one_acquire(address: str, request: qosd_pb2.AcquireRequest) -> None:
    """Makes sure the benchmarked request really is admitted before timing it."""
    with grpc.insecure_channel(address) as channel:
        call: Callable[..., qosd_pb2.AcquireResponse] = channel.unary_unary(
            ACQUIRE_PATH,
            request_serializer=qosd_pb2.AcquireRequest.SerializeToString,
            response_deserializer=qosd_pb2.AcquireResponse.FromString,
        )
        response = call(request, timeout=5)
    if response.decision != qosd_pb2.DECISION_ADMITTED:
        raise SystemExit(f"benchmark request not admitted: {response}")


def count_leases(url: str) -> int:
    """Leases written by the daemon: fields of the pool's per-second lease hashes."""
    client = redis.Redis.from_url(url)
    try:
        return sum(int(client.hlen(key)) for key in client.scan_iter("bench:{default}:leases:*"))
    finally:
        client.close()


if __name__ == "__main__":
    raise SystemExit(main())
