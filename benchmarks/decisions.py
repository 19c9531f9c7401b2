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

Every throughput round is metered over h2load's measuring window (after its warm-up):
Redis's ``INFO commandstats`` (reset with CONFIG RESETSTAT at the start) gives the
Redis time per Acquire, every command counted, and the mean batch (Acquires per
EVALSHA); /proc gives the daemon's CPU per 1,000 decisions (all threads, and every
process below it) and its RSS (sampled every 100 ms), and the machine's CPU, so that
what other processes used during the round is recorded too. The JSON holds these as
``redis_us_per_acquire``, ``redis_commands_per_acquire``, ``acquires_per_evalsha``
and ``sizing``; every round's raw figures are under ``rounds``.

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
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import grpc
import redis
import uvloop
from limits import RateLimitItemPerSecond
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from qosd_client.v1 import qosd_pb2
from qosd_harness import (
    OtlpReceiver,
    daemon_processes,
    otlp_receiver,
    redis_command,
    redis_server,
    source_commit,
)

NOOP_PATH = "/grpc.health.v1.Health/Check"
ACQUIRE_PATH = "/qosd.v1.QoS/Acquire"


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: flag byte 0 (not compressed), 4-byte length."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


#: h2load's warm-up, which its counts leave out; a meter starts this much later, plus
#: the slack h2load takes to connect first.
WARM_UP_S = 1.0
WINDOW_SLACK_S = 0.01


def h2load_command(
    address: str, path: str, body: Path, *, clients: int, streams: int, seconds: float,
    threads: int = 1, log_file: Path | None = None,
) -> list[str]:  # fmt: skip
    command = [
        "h2load", "-c", str(clients), "-m", str(streams), "-t", str(threads),
        "-D", f"{max(1, round(seconds))}", "--warm-up-time", f"{WARM_UP_S:g}",
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        "-d", str(body),
    ]  # fmt: skip
    if log_file is not None:
        command += ["--log-file", str(log_file)]
    command.append(f"http://{address}{path}")
    return command


def parse_h2load(output: str) -> dict[str, float]:
    result: dict[str, float] = {}
    for line in output.splitlines():
        if line.startswith("finished in"):
            result["rps"] = float(line.split(",")[1].split()[0])
        if line.startswith("requests:"):
            fields = line.replace(",", "").split()
            result["requests"] = float(fields[1])
            result["succeeded"] = float(fields[fields.index("succeeded") - 1])
    return result


def run_loads(
    commands: Sequence[Sequence[str]], meter: Meter | None = None
) -> tuple[list[dict[str, float]], dict[str, Any] | None]:
    """Runs load generators at once; with a meter, measures over their main duration
    (started after the warm-up h2load does not count). Returns each one's figures."""
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    window: dict[str, Any] | None = None
    try:
        if meter is not None:
            time.sleep(WARM_UP_S + WINDOW_SLACK_S)
            meter.start([process.pid for process in processes])
        outputs = [process.communicate() for process in processes]
        if meter is not None:
            window = meter.stop()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"h2load exited with {process.returncode}: {stderr[-2000:]}")
    return [parse_h2load(stdout) for stdout, _ in outputs], window


def run_h2load(
    address: str, path: str, body: Path, *, clients: int, streams: int, seconds: float,
    log_file: Path | None = None, meter: Meter | None = None,
) -> dict[str, Any]:  # fmt: skip
    command = h2load_command(
        address, path, body, clients=clients, streams=streams, seconds=seconds,
        log_file=log_file,
    )  # fmt: skip
    (result,), window = run_loads([command], meter)
    figures: dict[str, Any] = dict(result)
    if window is not None:
        figures["window"] = window
    if log_file is not None:
        # h2load's log: start time, HTTP status, duration in microseconds.
        durations = sorted(
            int(line.split("\t")[2]) / 1000 for line in log_file.read_text().splitlines() if line
        )
        figures["p50_ms"] = percentile(durations, 0.50)
        figures["p99_ms"] = percentile(durations, 0.99)
    return figures


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


# -- what a round cost: the daemon's processes, Redis, the machine ------------------


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (a supervisor's workers, their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def cpu_ticks(pids: Sequence[int]) -> int:
    """utime + stime of these processes, all their threads included (/proc/PID/stat),
    plus what their children that exited and were reaped had used (cutime, cstime)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
            total += sum(int(value) for value in fields[11:15])
    return total


def memory_kb(pids: Sequence[int], name: str) -> int:
    """A /proc/PID/status figure (VmRSS, VmHWM), in kB, summed over these processes."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(f"{name}:"):
                    total += int(line.split()[1])
                    break
    return total


def machine_ticks() -> tuple[int, int, int]:
    """Clock ticks of all CPUs so far (/proc/stat): busy in processes (user, nice,
    system), in interrupts (loopback networking runs there, charged to no process),
    and stolen by the hypervisor."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return user + nice + system, irq + softirq, steal


def script_commands() -> frozenset[str]:
    """The commands qosd's Lua scripts issue (``redis.call('HSET', ...)``). Redis
    counts each in INFO commandstats too, and its time is also inside the calling
    EVALSHA's, so a sum over every command counts them twice."""
    folder = resources.files("qosd.store").joinpath("lua")
    names: set[str] = set()
    for entry in folder.iterdir():
        if entry.name.endswith(".lua"):
            names.update(re.findall(r"redis\.p?call\('([A-Za-z]+)'", entry.read_text("utf-8")))
    return frozenset(name.lower() for name in names)


SCRIPT_COMMANDS = script_commands()


def redis_usec(stats: dict[str, dict[str, float]]) -> float:
    """Redis's time in commands, each counted once: the scripts (whose time includes
    the commands they issue) and every command no script issues."""
    return sum(v["usec"] for name, v in stats.items() if name not in SCRIPT_COMMANDS)


def commandstats(port: int) -> dict[str, dict[str, float]]:
    """INFO commandstats of the server on ``port``: {command: {calls, usec}}."""
    stats: dict[str, dict[str, float]] = {}
    for line in str(redis_command(port, "INFO", "commandstats")).splitlines():
        if not line.startswith("cmdstat_"):
            continue
        name, _, values = line.partition(":")
        pairs = dict(item.split("=") for item in values.split(","))
        stats[name.removeprefix("cmdstat_")] = {
            "calls": float(pairs["calls"]),
            "usec": float(pairs["usec"]),
            "failed_calls": float(pairs.get("failed_calls", 0)),
        }
    return stats


class RssSampler:
    """Samples the summed VmRSS of some process trees every ``interval_s`` in a thread."""

    def __init__(self, roots: Sequence[int], interval_s: float = 0.1) -> None:
        self._roots = list(roots)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak_kb = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            pids = [pid for root in self._roots for pid in process_tree(root)]
            self.peak_kb = max(self.peak_kb, memory_kb(pids, "VmRSS"))
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kb


@dataclass
class Meter:
    """What one throughput round cost, over h2load's measuring window (after its
    warm-up): CPU of the daemons' process trees, of the Redis servers and of the load
    generators, the machine's CPU and what other processes used of it, Redis's own
    commandstats (reset at the start), and the daemons' peak RSS."""

    daemons: Sequence[int]  # root pids: a daemon, or a supervisor and its workers
    redis_ports: Sequence[int]
    redis_pids: Sequence[int]
    # Read before the start and after the stop (outside the window), e.g. the leases
    # in Redis: its change over the window is reported as probe_delta.
    probe: Callable[[], float] | None = None
    _probe: float = 0.0
    _begin: float = 0.0
    _daemon_pids: list[int] = field(default_factory=list)
    _ticks: dict[str, int] = field(default_factory=dict)
    _machine: tuple[int, int, int] = (0, 0, 0)
    _load_pids: list[int] = field(default_factory=list)
    _children: float = 0.0
    _own: float = 0.0
    _sampler: RssSampler | None = None
    _redis_cpu: list[float] = field(default_factory=list)
    _daemon_each: list[int] = field(default_factory=list)

    def start(self, load_pids: Sequence[int] = ()) -> None:
        """``load_pids``: the load generators, children of this process still running;
        what they used up to now is subtracted from what they used in all."""
        if self.probe is not None:
            self._probe = self.probe()
        for port in self.redis_ports:
            redis_command(port, "CONFIG", "RESETSTAT")
        self._daemon_pids = [pid for root in self.daemons for pid in process_tree(root)]
        self._load_pids = list(load_pids)
        self._ticks = {
            "daemon": cpu_ticks(self._daemon_pids),
            "redis": cpu_ticks(self.redis_pids),
            "load": cpu_ticks(self._load_pids),
        }
        self._daemon_each = [cpu_ticks(process_tree(root)) for root in self.daemons]
        self._redis_cpu = [redis_cpu_s(port) for port in self.redis_ports]
        self._children = _children_cpu_s()
        self._own = time.process_time()
        self._machine = machine_ticks()
        self._sampler = RssSampler(self.daemons)
        self._begin = time.monotonic()

    def stop(self, load_alive: bool = False) -> dict[str, Any]:
        """Call once the load generators have exited and been reaped (``load_alive``:
        while they still run, to be stopped after)."""
        wall = time.monotonic() - self._begin
        tick = os.sysconf("SC_CLK_TCK")
        busy, interrupts, steal = (
            (now - then) / tick for now, then in zip(machine_ticks(), self._machine, strict=True)
        )
        pids = sorted({*self._daemon_pids, *(p for r in self.daemons for p in process_tree(r))})
        daemon = (cpu_ticks(pids) - self._ticks["daemon"]) / tick
        redis_cpu = (cpu_ticks(self.redis_pids) - self._ticks["redis"]) / tick
        if load_alive:
            load = (cpu_ticks(self._load_pids) - self._ticks["load"]) / tick
        else:
            load = _children_cpu_s() - self._children - self._ticks["load"] / tick
        daemon_each = [
            (cpu_ticks(process_tree(root)) - then) / tick
            for root, then in zip(self.daemons, self._daemon_each, strict=True)
        ]
        redis_each = [
            redis_cpu_s(port) - then
            for port, then in zip(self.redis_ports, self._redis_cpu, strict=True)
        ]
        own = time.process_time() - self._own
        stats: dict[str, dict[str, float]] = {}
        for port in self.redis_ports:
            for name, values in commandstats(port).items():
                into = stats.setdefault(name, {"calls": 0.0, "usec": 0.0, "failed_calls": 0.0})
                for key, value in values.items():
                    into[key] += value
        assert self._sampler is not None
        window: dict[str, Any] = {
            "wall_s": wall,
            "cpu_s": {
                "daemon": daemon,
                "redis": redis_cpu,
                "load_generator": load,
                "benchmark": own,
                "others": max(0.0, busy - daemon - redis_cpu - load - own),
                "machine_busy": busy,
                "interrupts": interrupts,
                "stolen": steal,
            },
            # Each daemon's share of a CPU, and each Redis server's (INFO cpu:
            # used_cpu_user + used_cpu_sys), over the window.
            "daemon_cpus_busy_each": [cpu / wall for cpu in daemon_each],
            "redis_cpus_busy_each": [cpu / wall for cpu in redis_each],
            "cpus": os.cpu_count() or 1,
            "daemon_processes": len(pids),
            "daemon_rss_peak_kb": self._sampler.stop(),
            "daemon_hwm_kb": memory_kb(pids, "VmHWM"),
            "commandstats": stats,
        }
        if self.probe is not None:
            window["probe_delta"] = self.probe() - self._probe
        return window


def redis_cpu_s(port: int) -> float:
    """CPU seconds the server on ``port`` has used (INFO cpu, its main thread and
    the others)."""
    info = dict(
        line.split(":", 1)
        for line in str(redis_command(port, "INFO", "cpu")).splitlines()
        if ":" in line
    )
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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


def median_of(rounds: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rounds)


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pins a process and everything below it, all their threads (gRPC runs C-core
    threads of its own; a supervisor runs workers)."""
    for process in process_tree(pid):
        with contextlib.suppress(OSError):
            for thread in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(thread), cpus)


@dataclass(frozen=True)
class Subject:
    address: str  # the daemon's
    path: str  # the RPC's
    body: Path  # one prebuilt gRPC frame
    pid: int  # the daemon's (the root of its process tree)


Subjects = dict[str, Subject]


def round_costs(figures: dict[str, Any]) -> dict[str, float]:
    """What one metered round cost per request answered in its window (h2load's
    succeeded count): Redis's command time (INFO commandstats, every command), the
    Redis process's CPU, the daemon's CPU per 1,000, and the mean batch."""
    done = max(1.0, float(figures["succeeded"]))
    window = figures["window"]
    cpu = window["cpu_s"]
    stats = window["commandstats"]
    evalsha = stats.get("evalsha", {}).get("calls", 0.0)
    costs = {
        "redis_us_per_request": redis_usec(stats) / done,
        # The sum over every cmdstat: the scripts' own commands counted twice.
        "redis_us_per_request_all_cmdstats": sum(v["usec"] for v in stats.values()) / done,
        "redis_cpu_us_per_request": cpu["redis"] * 1e6 / done,
        # Acquires per EVALSHA (any script: the SLO loop's few calls too); 0 for a
        # subject that writes no leases (the empty RPC).
        "requests_per_evalsha": done / evalsha if evalsha and "probe_delta" in window else 0.0,
        "daemon_cpu_ms_per_1000": cpu["daemon"] * 1e6 / done,
        "daemon_cpus_busy": cpu["daemon"] / window["wall_s"],
        "redis_cpus_busy": cpu["redis"] / window["wall_s"],
        "machine_cpus_busy": cpu["machine_busy"] / window["wall_s"],
        "others_cpu_s": cpu["others"],
        "daemon_rss_peak_mb": window["daemon_rss_peak_kb"] / 1024,
        "daemon_hwm_mb": window["daemon_hwm_kb"] / 1024,
    }
    if "probe_delta" in window:  # leases Redis wrote in the window: the count's check
        costs["leases_in_window_per_succeeded"] = window["probe_delta"] / done
    return costs


def commands_per_request(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per command of INFO commandstats, median over rounds: calls and µs per request."""
    names = sorted({name for r in rounds for name in r["window"]["commandstats"]})
    breakdown: dict[str, dict[str, float]] = {}
    for name in names:
        calls, usec = [], []
        for r in rounds:
            values = r["window"]["commandstats"].get(name, {"calls": 0.0, "usec": 0.0})
            done = max(1.0, float(r["succeeded"]))
            calls.append(values["calls"] / done)
            usec.append(values["usec"] / done)
        breakdown[name] = {
            "calls_per_request": statistics.median(calls),
            "us_per_request": statistics.median(usec),
            # Issued by a script: its time is inside EVALSHA's too.
            "inside_scripts": name in SCRIPT_COMMANDS,
        }
    return breakdown


def summarise_costs(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over rounds of round_costs; the peak RSS is the highest of any round."""
    each = [round_costs(r) for r in rounds]
    summary = {key: statistics.median(c[key] for c in each) for key in each[0]}
    summary["daemon_rss_peak_mb"] = max(c["daemon_rss_peak_mb"] for c in each)
    summary["daemon_hwm_mb"] = max(c["daemon_hwm_mb"] for c in each)
    summary["others_cpu_s_max"] = max(c["others_cpu_s"] for c in each)
    return summary


def print_round(tag: str, round_index: int, name: str, figures: dict[str, Any]) -> None:
    costs = round_costs(figures)
    line = (
        f"[{tag}] round {round_index + 1} {name:8s} {figures['rps']:9.0f} req/s; daemon "
        f"{costs['daemon_cpu_ms_per_1000']:.0f} CPU-ms/1000, {costs['daemon_cpus_busy']:.2f} "
        f"CPUs, RSS peak {costs['daemon_rss_peak_mb']:.0f} MB; Redis "
        f"{costs['redis_us_per_request']:.1f} µs/req in commands "
        f"({costs['redis_cpu_us_per_request']:.1f} µs CPU)"
    )
    if costs["requests_per_evalsha"]:
        line += f", {costs['requests_per_evalsha']:.1f} req/EVALSHA"
    print(line + f"; others {costs['others_cpu_s']:.2f} CPU-s")


def measure_mode(
    args: argparse.Namespace,
    subjects: Subjects,
    scratch: str,
    tag: str,
    meter_for: Callable[[Subject], Meter],
) -> dict[str, Any]:
    throughput: dict[str, list[dict[str, Any]]] = {name: [] for name in subjects}
    latency: dict[str, list[dict[str, Any]]] = {name: [] for name in subjects}
    for round_index in range(args.rounds):
        for name, subject in subjects.items():
            figures = run_h2load(
                subject.address, subject.path, subject.body, clients=args.clients,
                streams=args.streams, seconds=args.seconds, meter=meter_for(subject),
            )  # fmt: skip
            throughput[name].append(figures)
            print_round(tag, round_index, name, figures)
        for name, subject in subjects.items():
            log_file = Path(scratch, f"{tag}-{name}-{round_index}.log")
            figures = run_h2load(
                subject.address, subject.path, subject.body, clients=1, streams=1,
                seconds=args.latency_seconds, log_file=log_file,
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
    result["costs"] = {name: summarise_costs(throughput[name]) for name in subjects}
    result["commands"] = {name: commands_per_request(throughput[name]) for name in subjects}
    result["rounds"] = {
        name: [
            {"rps": r["rps"], "succeeded": r["succeeded"], **r["window"]} for r in throughput[name]
        ]
        for name in subjects
    }
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
    # Recorded at the start: the tree may change while the rounds run.
    commit = source_commit(Path(__file__).resolve().parents[1])
    load_before = os.getloadavg()[0]
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
            rss_at_rest_kb = memory_kb(process_tree(daemon.process.pid), "VmRSS")
            subjects: Subjects = {
                "noop": Subject(daemon.address, NOOP_PATH, noop_body, daemon.process.pid),
                "acquire": Subject(daemon.address, ACQUIRE_PATH, acquire_body, daemon.process.pid),
            }
            tracing_subjects: Subjects = {
                f"acquire_{name}": Subject(address, ACQUIRE_PATH, acquire_body, pid)
                for name, (address, pid) in traced.items()
            }
            for address, _ in traced.values():
                check_one_acquire(address, request)

            def meter_for(subject: Subject) -> Meter:
                assert server.process is not None
                return Meter(
                    daemons=[subject.pid],
                    redis_ports=[server.port],
                    redis_pids=[server.process.pid],
                    probe=(lambda: count_leases(server.url)) if subject.path == ACQUIRE_PATH
                    else None,
                )  # fmt: skip

            shared = measure_mode(
                args, {**subjects, **tracing_subjects}, scratch, "shared", meter_for
            )
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
                    pinned_result = measure_mode(args, subjects, scratch, "pinned", meter_for)
                finally:
                    os.sched_setaffinity(0, all_cpus)
                    set_affinity(server.process.pid, all_cpus)
            leases = count_leases(server.url)
            spans_exported = collector.received if collector else 0

    results: dict[str, Any] = {key: value for key, value in shared.items()}
    add_redis_costs(results)
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
        add_redis_costs(pinned_result)
        results["pinned"] = pinned_result
    acquired = shared["acquires_completed"] + (
        pinned_result["acquires_completed"] if pinned_result else 0
    )
    results["leases_created"] = leases
    results["sizing"] = sizing(shared, pinned_result, rss_at_rest_kb)
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
        "commit": commit,
        "load_average_before": load_before,
    }
    print_summary(results)
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
) -> Iterator[tuple[dict[str, tuple[str, int]], OtlpReceiver | None]]:
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
            assert traced.process is not None and traced_unsampled.process is not None
            yield (
                {
                    "traced": (traced.address, traced.process.pid),
                    "traced_unsampled": (traced_unsampled.address, traced_unsampled.process.pid),
                },
                collector,
            )


def add_redis_costs(results: dict[str, Any]) -> None:
    """The Acquire's Redis figures at the top of a mode's results."""
    costs = results["costs"]["acquire"]
    results["redis_us_per_acquire"] = costs["redis_us_per_request"]
    results["redis_cpu_us_per_acquire"] = costs["redis_cpu_us_per_request"]
    results["acquires_per_evalsha"] = costs["requests_per_evalsha"]
    results["redis_commands_per_acquire"] = results["commands"]["acquire"]


def sizing(
    shared: dict[str, Any], pinned: dict[str, Any] | None, rss_at_rest_kb: int
) -> dict[str, Any]:
    """CPU per 1,000 decisions and RSS at rest and under load, per subject and mode."""
    figures: dict[str, Any] = {"rss_at_rest_mb": rss_at_rest_kb / 1024}
    for tag, mode in (("shared", shared), ("pinned", pinned)):
        if mode is None:
            continue
        figures[tag] = {
            name: {
                "cpu_ms_per_1000": costs["daemon_cpu_ms_per_1000"],
                "cpus_busy": costs["daemon_cpus_busy"],
                "rss_under_load_peak_mb": costs["daemon_rss_peak_mb"],
                "vm_hwm_mb": costs["daemon_hwm_mb"],
            }
            for name, costs in mode["costs"].items()
        }
    figures["method"] = (
        "CPU: utime+stime of the daemon's process tree, all threads (/proc/PID/stat), "
        "over h2load's measuring window, / h2load's succeeded count x 1000; median of "
        "the throughput rounds. RSS at rest: VmRSS after start and one Acquire; under "
        "load: highest VmRSS sampled every 100 ms in any throughput round; VmHWM: the "
        "kernel's peak, read at each round's end (the process's whole life so far)."
    )
    return figures


def print_summary(results: dict[str, Any]) -> None:
    print()
    print("mode    subject   req/s    daemon CPU-ms/1000  RSS peak MB  Redis µs/req "
          "(commands, process CPU)  req/EVALSHA  others CPU-s (max)")  # fmt: skip
    for tag, mode in (("shared", results), ("pinned", results.get("pinned"))):
        if mode is None:
            continue
        for name, costs in mode["costs"].items():
            print(
                f"{tag:7s} {name:9s} {mode[name + '_rps']:7.0f}  "
                f"{costs['daemon_cpu_ms_per_1000']:18.0f}  {costs['daemon_rss_peak_mb']:11.0f}  "
                f"{costs['redis_us_per_request']:12.1f} {costs['redis_cpu_us_per_request']:10.1f}"
                f"{'':14s}{costs['requests_per_evalsha']:11.1f}  "
                f"{costs['others_cpu_s_max']:.2f}"
            )
    print(
        f"RSS at rest (after start and one Acquire): {results['sizing']['rss_at_rest_mb']:.0f} MB"
    )
    print(
        f"Acquire / noop: {results['acquire_vs_noop_rps']:.2f} throughput, "
        f"{results['acquire_vs_noop_p50']:.2f} p50; Redis {results['redis_us_per_acquire']:.1f} "
        "µs per Acquire (target ≤ 20)"
    )
    print("  per command (inside: issued by a script, its time also in EVALSHA's):")
    for name, values in results["redis_commands_per_acquire"].items():
        if values["calls_per_request"] >= 0.0005:
            print(
                f"  {name:12s} {values['calls_per_request']:8.3f} calls, "
                f"{values['us_per_request']:6.2f} µs per Acquire"
                + (" (inside)" if values["inside_scripts"] else "")
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
