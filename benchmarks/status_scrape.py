"""Status scrapes at many leases: Acquire latency while ``/metrics`` and
``Admin/GetStatus`` are read every second, with N lease records in Redis.

    python benchmarks/status_scrape.py --leases 120000 --json results/status_scrape.json

A status read must not cost Redis time in proportion to the leases it holds: Redis
runs one script at a time, so a script that reads every lease record blocks every
Acquire of the fleet while it runs. This benchmark fills a store with N live leases
and shows what a scrape costs the Acquires around it:

- It starts its own redis-server and one ``qosd serve`` process on it, with
  ``server.http_listen`` on (for ``/metrics``) and a pool so large that every Acquire
  is admitted; the lease TTL is the default (300 s).
- fill: ``--fill-concurrency`` tasks call Acquire over gRPC until N leases are
  admitted, never releasing them. GetStatus (``active_leases``) and ``/metrics``
  (``qosd_active_leases``) must then say N, and the fields of the pool's lease
  hashes (HLEN over SCAN) must number N.
- Two phases of ``--seconds`` each, side by side, with the same open-loop load of
  ``--rate`` Acquire/s (each followed by its Release, so the live leases stay N; a
  released lease's record stays as a tombstone, so the records grow a little):
  (a) nothing else; (b) a GET of ``/metrics`` and a GetStatus every second,
  concurrently. Acquire latency is timed from the moment the call was due, so a
  stalled client or daemon shows in it.
- Redis's own view of each phase: the SLOWLOG at a 5 ms threshold (commands that
  took that long: expected none), ``INFO commandstats`` (EVALSHA calls and mean
  duration) and ``LATENCY LATEST`` at a 1 ms threshold.
- CPU time, per phase, of this run's processes and of everything else on the machine
  (these machines are shared: a phase where something else ran is flagged).
- A probe of ``--probe-seconds`` with the same load and scrapes, and the SLOWLOG
  threshold at 0 (every command logged; not timed for the phases' figures): the
  longest single command, and the durations of each script, named by its SHA1.

Leases admitted by the fill expire after 300 s, so the run checks at the end that
all N are still live (a run takes about N / 6,000 + 2 x ``--seconds`` + 10 s here).
It exits 1 when a check fails or an Acquire of the phases was refused or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import redis
import redis.asyncio as aioredis
import uvloop

from qosd.store.redis import SCRIPTS, script_source
from qosd_client import QosdClient, QosdError
from qosd_harness import daemon_processes, redis_server

POOL = "default"
PREFIX = "bench"
LEASE_PATTERN = f"{PREFIX}:{{{POOL}}}:leases:*"
SLOW_US = 5_000  # the SLOWLOG threshold of the phases


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def summary_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50_ms": percentile(ordered, 0.50),
        "p99_ms": percentile(ordered, 0.99),
        "max_ms": ordered[-1] if ordered else float("nan"),
    }


def script_names() -> dict[str, str]:
    """SHA1 -> script name, for every script the daemon loads (as qosd/store/redis.py
    assembles them: the contract's constants and the pool prelude prepended)."""
    return {hashlib.sha1(script_source(name).encode("utf-8")).hexdigest(): name for name in SCRIPTS}


# -- Redis: what the store holds, and what Redis saw --------------------------------


async def lease_records(client: aioredis.Redis) -> dict[str, int]:
    """Fields of the pool's lease hashes: all of them (HLEN over SCAN), and how many
    are settled ("R|..."; released leases stay as tombstones), counted with HSCAN."""
    keys = [key async for key in client.scan_iter(match=LEASE_PATTERN, count=1000)]
    fields = 0
    settled = 0
    for key in keys:
        fields += int(await client.hlen(key))
        async for _name, value in client.hscan_iter(key, count=1000):
            if value.startswith(b"R|"):
                settled += 1
    return {"hashes": len(keys), "fields": fields, "settled": settled}


async def redis_watch_start(client: aioredis.Redis, slower_than_us: int, max_len: int) -> None:
    await client.config_set("slowlog-log-slower-than", slower_than_us)
    await client.config_set("slowlog-max-len", max_len)
    await client.config_set("latency-monitor-threshold", 1)
    await client.slowlog_reset()
    await client.latency_reset()
    await client.config_resetstat()


def decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def slowlog_entries(client: aioredis.Redis, count: int) -> list[dict[str, Any]]:
    """SLOWLOG GET: each entry's duration and its command's arguments (Redis keeps up to
    32 of them, each cut to 128 bytes: enough for a script's SHA1)."""
    entries = []
    for item in await client.slowlog_get(count):
        command = item.get("command", b"")
        args = [decode(a) for a in command.split()] if isinstance(command, bytes) else []
        entries.append({"duration_us": int(item["duration"]), "args": args})
    return entries


def describe(args: list[str], names: dict[str, str]) -> str:
    if not args:
        return "?"
    command = args[0].upper()
    if command in ("EVALSHA", "EVALSHA_RO") and len(args) > 1:
        return f"EVALSHA {names.get(args[1], args[1][:12])}"
    return command


async def redis_watch_end(
    client: aioredis.Redis, names: dict[str, str], slowlog_count: int = 128
) -> dict[str, Any]:
    entries = await slowlog_entries(client, slowlog_count)
    slow = [e for e in entries if e["duration_us"] >= SLOW_US]
    stats = await client.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {})
    latest = await client.latency_latest()
    # LATENCY LATEST: event name, when it last happened, its latest and its max (ms).
    latency_events = {
        decode(event[0]): {"latest_ms": int(str(event[2])), "max_ms": int(str(event[3]))}
        for event in latest
    }
    return {
        "slowlog_threshold_us": SLOW_US,
        "commands_over_5ms": len(slow),
        "slowest_logged": [
            {"command": describe(e["args"], names), "duration_us": e["duration_us"]}
            for e in sorted(slow, key=lambda e: -e["duration_us"])[:5]
        ],
        "evalsha_calls": int(evalsha.get("calls", 0)),
        "evalsha_usec_per_call": float(evalsha.get("usec_per_call", 0.0)),
        "latency_events_over_1ms": latency_events,
    }


# -- the machine: these machines are shared, so say what else ran ------------------


def _machine_ticks() -> tuple[int, int, int]:
    """Clock ticks of all CPUs so far (/proc/stat): busy in processes (user, nice,
    system), in interrupts (loopback networking runs there, charged to no process),
    and stolen by the hypervisor."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return user + nice + system, irq + softirq, steal


def _process_ticks(pids: tuple[int, ...]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            rest = stat.read().rpartition(")")[2].split()
        total += int(rest[11]) + int(rest[12])  # utime, stime: all threads
    return total


@dataclass
class CpuWatch:
    """CPU time of this run's processes (this one, the daemon, redis-server) and of
    everything else on the machine, between construction and ``stop``."""

    pids: tuple[int, ...]
    begin: float = 0.0
    machine: tuple[int, int, int] = (0, 0, 0)
    ours: int = 0

    def __post_init__(self) -> None:
        self.begin = time.monotonic()
        self.machine = _machine_ticks()
        self.ours = _process_ticks(self.pids)

    def stop(self) -> dict[str, float]:
        tick = os.sysconf("SC_CLK_TCK")
        busy, interrupts, steal = (
            (now - then) / tick for now, then in zip(_machine_ticks(), self.machine, strict=True)
        )
        ours = (_process_ticks(self.pids) - self.ours) / tick
        return {
            "wall_s": time.monotonic() - self.begin,
            "cpu_s_ours": ours,
            "cpu_s_others": max(0.0, busy - ours),
            "cpu_s_interrupts": interrupts,
            "cpu_s_stolen": steal,
        }


# -- the load ------------------------------------------------------------------------


@dataclass
class LoadFigures:
    latencies_ms: list[float] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    release_errors: Counter[str] = field(default_factory=Counter)
    late_start_ms: float = 0.0  # how far behind schedule the generator got, at worst

    def summary(self, rate: float, seconds: float) -> dict[str, Any]:
        return {
            "offered": round(rate * seconds),
            "acquire": summary_ms(self.latencies_ms),
            "rejected_by_reason": dict(self.rejected),
            "errors": dict(self.errors),
            "release_errors": dict(self.release_errors),
            "generator_late_max_ms": self.late_start_ms,
        }


async def open_loop(qos: QosdClient, rate: float, seconds: float) -> LoadFigures:
    """``rate`` Acquire/s for ``seconds``, each started on schedule whatever the
    others are doing, and released once admitted."""
    figures = LoadFigures()
    tasks: set[asyncio.Task[None]] = set()

    async def one(due: float) -> None:
        try:
            result = await qos.acquire(
                "P1", 100, model=POOL, tenant="load", max_wait_ms=0, timeout_s=10
            )
        except QosdError as error:
            figures.errors[type(error).__name__] += 1
            return
        figures.latencies_ms.append((time.perf_counter() - due) * 1000)
        if not result.admitted:
            figures.rejected[result.reason.name] += 1
            return
        try:
            await qos.release(result.lease_id, output_tokens=10, timeout_s=10)
        except QosdError as error:
            figures.release_errors[type(error).__name__] += 1

    start = time.perf_counter()
    for index in range(round(rate * seconds)):
        due = start + index / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            figures.late_start_ms = max(figures.late_start_ms, -delay * 1000)
        task = asyncio.create_task(one(due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return figures


@dataclass
class Scrapes:
    metrics_ms: list[float] = field(default_factory=list)
    status_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    active_leases: list[int] = field(default_factory=list)  # as GetStatus said

    def summary(self) -> dict[str, Any]:
        def brief(values: list[float]) -> dict[str, float]:
            ordered = sorted(values)
            return {
                "count": len(ordered),
                "p50_ms": percentile(ordered, 0.5),
                "max_ms": ordered[-1] if ordered else float("nan"),
            }

        return {
            "metrics": brief(self.metrics_ms),
            "get_status": brief(self.status_ms),
            "errors": dict(self.errors),
            "active_leases_min": min(self.active_leases, default=0),
            "active_leases_max": max(self.active_leases, default=0),
        }


async def timed(into: list[float], errors: Counter[str], call: Awaitable[Any]) -> Any:
    begin = time.perf_counter()
    try:
        result = await call
    except (QosdError, aiohttp.ClientError, TimeoutError) as error:
        errors[type(error).__name__] += 1
        return None
    into.append((time.perf_counter() - begin) * 1000)
    return result


async def scrape_every_second(
    qos: QosdClient, http: aiohttp.ClientSession, metrics_url: str, seconds: float
) -> Scrapes:
    """A GET of /metrics and a GetStatus, concurrently, once a second."""
    scrapes = Scrapes()

    async def get_metrics() -> str:
        async with http.get(metrics_url) as response:
            response.raise_for_status()
            return await response.text()

    start = time.perf_counter()
    for tick in range(max(1, round(seconds))):
        delay = start + tick - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        _, status = await asyncio.gather(
            timed(scrapes.metrics_ms, scrapes.errors, get_metrics()),
            timed(scrapes.status_ms, scrapes.errors, qos.status(POOL, timeout_s=10)),
        )
        if status is not None:
            scrapes.active_leases.append(status.pool(POOL).active_leases)
    return scrapes


def metrics_active_leases(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f'qosd_active_leases{{pool="{POOL}"}}'):
            return float(line.split()[-1])
    return None


# -- the fill ------------------------------------------------------------------------


async def fill(qos: QosdClient, leases: int, concurrency: int) -> dict[str, Any]:
    """Acquires until ``leases`` are admitted; releases none."""
    admitted = 0
    rejected: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    claimed = 0

    async def worker() -> None:
        nonlocal admitted, claimed
        while claimed < leases:
            claimed += 1
            try:
                result = await qos.acquire(
                    "P1", 100, model=POOL, tenant="fill", max_wait_ms=0, timeout_s=10
                )
            except QosdError as error:
                errors[type(error).__name__] += 1
                claimed -= 1
                continue
            if result.admitted:
                admitted += 1
            else:
                rejected[result.reason.name] += 1
                claimed -= 1

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - begin
    return {
        "leases": admitted,
        "seconds": elapsed,
        "acquires_per_s": admitted / elapsed,
        "concurrency": concurrency,
        "rejected_by_reason": dict(rejected),
        "errors": dict(errors),
    }


# -- the run -------------------------------------------------------------------------


async def run(
    args: argparse.Namespace, redis_url: str, address: str, http_port: int, pids: tuple[int, ...]
) -> Any:
    names = script_names()
    metrics_url = f"http://127.0.0.1:{http_port}/metrics"
    client = aioredis.Redis.from_url(redis_url)
    results: dict[str, Any] = {}
    async with (
        QosdClient(address, timeout_s=10) as qos,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
    ):
        await qos.status(POOL)  # connect; the pool exists

        print(f"fill: {args.leases:,} Acquires, {args.fill_concurrency} at a time ...")
        await redis_watch_start(client, SLOW_US, 128)
        cpu = CpuWatch(pids)
        filled = await fill(qos, args.leases, args.fill_concurrency)
        filled["cpu"] = cpu.stop()
        fill_redis = await redis_watch_end(client, names)
        filled_at = time.monotonic()
        status = await qos.status(POOL)
        async with http.get(metrics_url) as response:
            metrics_text = await response.text()
        records = await lease_records(client)
        filled.update(
            get_status_active_leases=status.pool(POOL).active_leases,
            metrics_active_leases=metrics_active_leases(metrics_text),
            lease_records=records,
            redis=fill_redis,
        )
        results["fill"] = filled
        print(
            f"fill: {filled['leases']:,} leases in {filled['seconds']:.1f} s "
            f"({filled['acquires_per_s']:,.0f}/s); GetStatus says "
            f"{filled['get_status_active_leases']:,}, /metrics "
            f"{filled['metrics_active_leases']}, lease hashes hold {records['fields']:,} "
            f"fields in {records['hashes']} hashes"
        )
        print(f"fill: CPU: {cpu_line(filled['cpu'])}")

        phases: dict[str, Any] = {}
        for name, scraping in (("no_scrape", False), ("scrape", True)):
            await settle()
            await redis_watch_start(client, SLOW_US, 128)
            cpu = CpuWatch(pids)
            load_task = asyncio.create_task(open_loop(qos, args.rate, args.seconds))
            scrapes = (
                await scrape_every_second(qos, http, metrics_url, args.seconds)
                if scraping
                else None
            )
            load = await load_task
            phase = load.summary(args.rate, args.seconds)
            phase["cpu"] = cpu.stop()
            phase["redis"] = await redis_watch_end(client, names)
            if scrapes is not None:
                phase["scrapes"] = scrapes.summary()
            phases[name] = phase
            print_phase(name, phase)
        results["phases"] = phases

        # Every command logged (threshold 0) for a short window under the same load.
        await settle()
        await redis_watch_start(client, 0, 100_000)
        probe_task = asyncio.create_task(open_loop(qos, args.rate, args.probe_seconds))
        probe_scrapes = await scrape_every_second(qos, http, metrics_url, args.probe_seconds)
        await probe_task
        entries = await slowlog_entries(client, 100_000)
        await client.config_set("slowlog-max-len", 128)
        await client.config_set("slowlog-log-slower-than", 10_000)
        results["probe"] = probe_figures(entries, names, args.probe_seconds, probe_scrapes)
        print_probe(results["probe"])

        status = await qos.status(POOL)
        results["after"] = {
            "get_status_active_leases": status.pool(POOL).active_leases,
            "lease_records": await lease_records(client),
            "seconds_since_fill": time.monotonic() - filled_at,
        }
        print(
            f"after: GetStatus says {results['after']['get_status_active_leases']:,} active; "
            f"lease hashes hold {results['after']['lease_records']['fields']:,} fields "
            f"({results['after']['lease_records']['settled']:,} settled)"
        )
    await client.aclose()
    return results


async def settle() -> None:
    """Between phases: this process's garbage collected (not in the next phase), and a
    second for the daemon and Redis to finish what the last step left them."""
    gc.collect()
    await asyncio.sleep(1.0)


def probe_figures(
    entries: list[dict[str, Any]], names: dict[str, str], seconds: float, scrapes: Scrapes
) -> dict[str, Any]:
    by_command: dict[str, list[int]] = {}
    for entry in entries:
        by_command.setdefault(describe(entry["args"], names), []).append(entry["duration_us"])
    longest = max(entries, key=lambda e: e["duration_us"], default=None)
    return {
        "seconds": seconds,
        "commands_logged": len(entries),
        "longest": {
            "command": describe(longest["args"], names) if longest else "",
            "duration_us": longest["duration_us"] if longest else 0,
        },
        "by_command": {
            name: {
                "calls": len(durations),
                "median_us": statistics.median(durations),
                "max_us": max(durations),
            }
            for name, durations in sorted(by_command.items(), key=lambda kv: -max(kv[1]))
        },
        "scrapes": scrapes.summary(),
    }


def print_phase(name: str, phase: dict[str, Any]) -> None:
    acquire = phase["acquire"]
    line = (
        f"[{name:9s}] Acquire p50 {acquire['p50_ms']:.2f} ms, p99 {acquire['p99_ms']:.2f} ms, "
        f"max {acquire['max_ms']:.2f} ms ({acquire['count']} answered; rejected "
        f"{phase['rejected_by_reason'] or 0}, errors {phase['errors'] or 0})"
    )
    print(line)
    print(f"[{name:9s}] CPU: {cpu_line(phase['cpu'])}")
    redis_view = phase["redis"]
    print(
        f"[{name:9s}] Redis: {redis_view['commands_over_5ms']} commands >= 5 ms; "
        f"EVALSHA {redis_view['evalsha_calls']} calls, "
        f"{redis_view['evalsha_usec_per_call']:.1f} us each; latency events >= 1 ms: "
        f"{redis_view['latency_events_over_1ms'] or 'none'}"
    )
    if "scrapes" in phase:
        scrapes = phase["scrapes"]
        print(
            f"[{name:9s}] /metrics p50 {scrapes['metrics']['p50_ms']:.2f} ms max "
            f"{scrapes['metrics']['max_ms']:.2f} ms; GetStatus p50 "
            f"{scrapes['get_status']['p50_ms']:.2f} ms max {scrapes['get_status']['max_ms']:.2f}"
            f" ms ({scrapes['get_status']['count']} each; errors {scrapes['errors'] or 0})"
        )


def cpu_line(cpu: dict[str, float]) -> str:
    line = (
        f"this run's processes {cpu['cpu_s_ours']:.1f} s, others {cpu['cpu_s_others']:.1f} s, "
        f"interrupts {cpu['cpu_s_interrupts']:.1f} s, stolen {cpu['cpu_s_stolen']:.1f} s "
        f"in {cpu['wall_s']:.1f} s"
    )
    if cpu["cpu_s_others"] + cpu["cpu_s_stolen"] > 0.1 * cpu["wall_s"]:
        line += " (warning: something else ran; the figures are noisy)"
    return line


def print_probe(probe: dict[str, Any]) -> None:
    print(
        f"[probe    ] {probe['commands_logged']} commands in {probe['seconds']:g} s; longest "
        f"{probe['longest']['command']} {probe['longest']['duration_us']} us"
    )
    for name, figures in probe["by_command"].items():
        print(
            f"[probe    ]   {name:20s} {figures['calls']:6d} calls, median "
            f"{figures['median_us']:g} us, max {figures['max_us']} us"
        )


def check(results: dict[str, Any], leases: int) -> list[str]:
    """What must hold for the figures to mean anything."""
    problems = []
    fill_figures = results["fill"]
    if fill_figures["get_status_active_leases"] != leases:
        problems.append(f"GetStatus said {fill_figures['get_status_active_leases']} active")
    if fill_figures["metrics_active_leases"] != leases:
        problems.append(f"/metrics said {fill_figures['metrics_active_leases']} active")
    if fill_figures["lease_records"]["fields"] != leases:
        problems.append(f"the lease hashes hold {fill_figures['lease_records']['fields']}")
    if results["after"]["get_status_active_leases"] != leases:
        problems.append(
            f"after the phases GetStatus said {results['after']['get_status_active_leases']}"
            " active (leases of the fill expired, or Releases were lost)"
        )
    for name, phase in results["phases"].items():
        if phase["errors"] or phase["rejected_by_reason"]:
            problems.append(f"{name}: errors {phase['errors']}, rejected "
                            f"{phase['rejected_by_reason']}")  # fmt: skip
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="results/status_scrape.json", help="write here")
    parser.add_argument("--leases", type=int, default=120_000, help="live leases to fill")
    parser.add_argument("--rate", type=float, default=300.0, help="Acquire/s in the phases")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--probe-seconds", type=float, default=3.0, help="SLOWLOG-0 window")
    parser.add_argument("--fill-concurrency", type=int, default=200, help="Acquires at once")
    parser.add_argument("--label", default="", help="kept in the JSON (say which code ran)")
    args = parser.parse_args()

    with redis_server() as server:
        config = {
            "redis": {"url": server.url, "key_prefix": PREFIX},
            "server": {"http_listen": "127.0.0.1:0"},  # the ready file says which port
            "pools": {POOL: {"capacity_tokens_s": 1e9}},
        }
        with daemon_processes(config) as (daemon,):
            assert server.process is not None and daemon.process is not None
            pids = (os.getpid(), daemon.process.pid, server.process.pid)
            http_port = int(daemon.ready["http"].rpartition(":")[2])
            results: dict[str, Any] = uvloop.run(
                run(args, server.url, daemon.address, http_port, pids)
            )
            with redis.Redis.from_url(server.url) as info_client:
                redis_version = info_client.info("server")["redis_version"]

    results["setup"] = {
        "label": args.label,
        "leases": args.leases,
        "rate_per_s": args.rate,
        "seconds_per_phase": args.seconds,
        "probe_seconds": args.probe_seconds,
        "acquire": "P1, 100 input tokens, max_wait_ms 0; each admitted one released",
        "scrape": "GET /metrics and Admin/GetStatus, concurrently, once a second",
        "lease_ttl_s": 300,
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "redis_server": redis_version,
    }
    problems = check(results, args.leases)
    results["problems"] = problems
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
