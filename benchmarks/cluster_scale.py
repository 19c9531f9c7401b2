"""Cluster scale-out: Acquire throughput of a Redis Cluster of ``--shards`` shards
against one shard, on independent pools, side by side in one run.

    python benchmarks/cluster_scale.py --json results/cluster_scale.json

Two clusters are started at once: one of a single node that owns every slot, and one
of ``--shards`` nodes (no replicas). The pools are chosen by CLUSTER KEYSLOT of their
keys (``bench:{pool}:...``, one hash tag per pool) so that each shard of the larger
cluster owns ``--pools-per-shard`` of them; the single node owns them all. Each figure
is measured in rounds that alternate between the two clusters, with the same load;
the median round is reported. Two ways:

- **Redis-bound**: qosd's acquire script, loaded by qosd's own store, driven with the
  exact KEYS and ARGV the daemon sends for a batch of ``--batch`` Acquires (captured
  from qosd's RedisStore as it sends them, with no deadline, as a daemon sends before
  it knows Redis's clock), by redis-benchmark (C; ``-c`` connections with ``-P``
  commands pipelined each, one process per pool, connected to the pool's shard).
  The captured batch is replayed as it is: each replay admits the same leases again,
  overwriting their records, so memory stays flat while every replay does an
  admission's work. Throughput is counted by Redis (EVALSHA calls in the window x the
  batch), and each shard's CPU (INFO cpu) tells whether Redis was the bound.
- **End to end**: ``--daemons`` ``qosd serve`` processes per cluster (``redis.mode:
  cluster``), each driven by one h2load per pool (prebuilt frames of an Acquire for
  that pool's model), so requests spread over every pool and daemon.

Every round records each shard's and each daemon's CPU use, the machine's, and what
other processes used, and names what bounded it. A shard can only show its scale-out
on a CPU of its own: on a machine with fewer CPUs than shards plus clients, the
machine's CPUs are the bound and the ratio says so, not what Redis Cluster can do.
With enough CPUs (``--shards`` + 2 or more) the shards are pinned one to a CPU, and
the clients (and daemons) to the rest; the default counts of daemons follow
os.cpu_count().
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from qosd.config import Config
from qosd.model import LeaseSpec, new_lease_token
from qosd.policy import resolve_pools
from qosd.server import make_store
from qosd.store import contract
from qosd.store.contract import Status
from qosd.store.redis import RedisStore
from qosd_client.v1 import qosd_pb2
from qosd_harness import RedisServer, daemon_processes, redis_command

if __package__ in (None, ""):  # run as a script: python benchmarks/cluster_scale.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decisions import (
    ACQUIRE_PATH,
    Meter,
    check_one_acquire,
    grpc_frame,
    h2load_command,
    run_loads,
    set_affinity,
)

PREFIX = "bench"
SLOTS = 16384


# -- clusters --------------------------------------------------------------------------


@contextlib.contextmanager
def cluster(size: int) -> Iterator[list[RedisServer]]:
    """A Redis Cluster of ``size`` masters, no replicas, slots split evenly; a single
    node owns every slot (redis-cli --cluster create wants three at least)."""
    with tempfile.TemporaryDirectory(prefix="qosd-bench-cluster-") as directory:
        nodes: list[RedisServer] = []
        try:
            for index in range(size):
                node_dir = Path(directory) / f"node{index}"
                # Port 0: the harness reserves the node's port and its bus port.
                node = RedisServer(
                    0, node_dir,
                    (
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout", "5000",
                    ),
                    cluster_bus=True,
                )  # fmt: skip
                nodes.append(node)
                node.start()
            for index, node in enumerate(nodes):
                first, last = index * SLOTS // size, (index + 1) * SLOTS // size - 1
                redis_command(node.port, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
            for node in nodes[1:]:
                redis_command(
                    nodes[0].port, "CLUSTER", "MEET", "127.0.0.1", str(node.port),
                    str(node.bus_port),
                )  # fmt: skip
            deadline = time.monotonic() + 30
            while not all(_cluster_ok(node.port, size) for node in nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a {size}-node cluster did not reach cluster_state:ok")
                time.sleep(0.1)
            yield nodes
        finally:
            for node in nodes:
                node.close()


def _cluster_ok(port: int, size: int) -> bool:
    info = str(redis_command(port, "CLUSTER", "INFO"))
    return "cluster_state:ok" in info and f"cluster_known_nodes:{size}\r" in info


def slot_owner(nodes: list[RedisServer], slot: int) -> int:
    """Index of the node that owns ``slot``, by what the first node says."""
    for first, last, master, *_ in redis_command(nodes[0].port, "CLUSTER", "SLOTS"):
        if int(first) <= slot <= int(last):
            port = int(master[1])
            return next(i for i, node in enumerate(nodes) if node.port == port)
    raise RuntimeError(f"no node owns slot {slot}")


def choose_pools(nodes: list[RedisServer], per_shard: int) -> dict[str, int]:
    """Pool names whose keys map to each shard, ``per_shard`` each: {pool: shard}."""
    chosen: dict[str, int] = {}
    counts = [0] * len(nodes)
    candidate = 0
    while min(counts) < per_shard:
        name = f"pool{candidate}"
        candidate += 1
        slot = int(redis_command(nodes[0].port, "CLUSTER", "KEYSLOT", f"{PREFIX}:{{{name}}}:state"))
        owner = slot_owner(nodes, slot)
        if counts[owner] < per_shard:
            counts[owner] += 1
            chosen[name] = owner
    return chosen


def daemon_config(url: str, pools: list[str]) -> dict[str, Any]:
    return {
        "redis": {"url": url, "mode": "cluster", "key_prefix": PREFIX},
        "pools": {name: {"capacity_tokens_s": 1e9, "models": [name]} for name in pools},
        "default_pool": pools[0],
    }


def request_for(pool: str) -> qosd_pb2.AcquireRequest:
    return qosd_pb2.AcquireRequest(
        tenant="bench", model=pool, qos_class="P1",
        input_tokens=100, expected_output_tokens=50, max_wait_ms=0,
    )  # fmt: skip


# -- the exact script calls qosd sends -------------------------------------------------


async def capture_batches(url: str, pools: list[str], batch: int) -> dict[str, list[str]]:
    """Per pool, the EVALSHA a daemon's store sends for ``batch`` Acquires that queued
    together (the request decisions.py sends: P1, 100 prompt and 50 output tokens),
    captured from qosd's RedisStore on its way to Redis; the store also loads the
    scripts on every node."""
    config = Config.model_validate(daemon_config(url, pools))
    policies = resolve_pools(config)
    store = make_store(config)
    assert isinstance(store, RedisStore)
    await store.start()
    client = store._client
    original = client.execute
    captured: dict[str, list[str]] = {}
    acquire_sha = store._scripts["acquire"].sha

    async def execute(route_key: str, *args: Any, script_source: str | None = None) -> Any:
        if args[:2] == ("EVALSHA", acquire_sha):
            pool = route_key.split("{", 1)[1].split("}", 1)[0]
            captured[pool] = [str(arg) for arg in args]
        return await original(route_key, *args, script_source=script_source)

    setattr(client, "execute", execute)  # noqa: B010 - wraps the instance's method
    # No deadline, as a daemon sends before it knows Redis's clock: a replay of the
    # same call later must still be run, not refused as late.
    setattr(store, "_acquire_deadline", lambda: "0")  # noqa: B010
    try:
        for name in pools:
            pool = policies[name]
            cls = next(c for c in pool.classes if c.name == "P1")

            def lease(pool_name: str = name, weight: float = cls.weight) -> LeaseSpec:
                return LeaseSpec(
                    lease_id=f"{pool_name}:P1:{new_lease_token()}",
                    request_id="",
                    tenant="bench",
                    input_tokens=100,
                    output_tokens=50,
                    weight=weight,
                    ttl_ms=int(config.lease.ttl_s * 1000),
                )

            await store.acquire(pool, cls, lease(), 0)  # the pool's state
            decisions = await asyncio.gather(
                *(store.acquire(pool, cls, lease(), 0) for _ in range(batch))
            )
            if not all(d.admitted for d in decisions):
                raise RuntimeError(f"pool {name}: the captured batch was not all admitted")
            if int(captured[name][3 + int(captured[name][2])]) != batch:
                raise RuntimeError(f"pool {name}: captured a batch of another size")
    finally:
        await store.close()
    return captured


def check_replay(port: int, command: list[str], batch: int) -> None:
    """The captured call, sent again as redis-benchmark will: every Acquire admitted."""
    reply = redis_command(port, *command)
    header = contract.size(contract.AcquireHeader)
    decisions = contract.records(contract.Decision, reply, batch, header)
    if any(d.status != Status.ADMITTED for d in decisions):
        raise RuntimeError(f"a replayed batch was not admitted: {reply[:20]}")


# -- CPU layout --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    shards: list[int] | None  # shard i on shards[i]; None: not pinned
    daemons: list[int] | None
    load: list[int] | None
    note: str


def plan(cpus: list[int], shards: int, pin: str) -> Layout:
    if pin == "none" or len(cpus) < shards + 2:
        why = "--pin none" if pin == "none" else f"fewer than {shards} + 2 CPUs"
        return Layout(None, None, None, f"nothing pinned ({why}): all share CPUs {cpus}")
    shard_cpus, rest = cpus[:shards], cpus[shards:]
    daemons = rest[: max(1, len(rest) * 2 // 3)]
    load = rest[len(daemons) :] or rest
    return Layout(
        shard_cpus, daemons, load,
        f"shard i on CPU {shard_cpus}[i] (the single node on {shard_cpus[0]}); daemons on "
        f"{daemons}, h2load on {load}; redis-benchmark on {rest}",
    )  # fmt: skip


def pin_all(pids: list[int], cpus: list[int] | None, fallback: list[int]) -> None:
    for pid in pids:
        set_affinity(pid, set(cpus or fallback))


# -- what bounded a round ----------------------------------------------------------------


def bound(window: dict[str, Any], daemons: int) -> str:
    """What bounded a round, from its CPU figures: the first saturated resource."""
    cpus = window["cpus"]
    machine = window["cpu_s"]["machine_busy"] / window["wall_s"]
    shards = window["redis_cpus_busy_each"]
    reasons = []
    if machine >= 0.9 * cpus:
        reasons.append(f"machine CPU: {machine:.2f} of {cpus} cores busy")
    hot = [f"shard {i} {u:.0%}" for i, u in enumerate(shards) if u >= 0.9]
    if hot:
        reasons.append("Redis: " + ", ".join(hot) + " of a core")
    busy = [u for u in window["daemon_cpus_busy_each"] if u >= 0.9]
    if daemons and busy:
        reasons.append(f"daemons: {len(busy)} of {daemons} at ≥ 90% of a core")
    if not reasons:
        reasons.append(
            f"nothing saturated (machine {machine:.2f} of {cpus} cores, shards "
            + ", ".join(f"{u:.0%}" for u in shards)
            + "): the clients' concurrency"
        )
    return "; ".join(reasons)


def round_summary(window: dict[str, Any], acquires: float) -> dict[str, Any]:
    wall = window["wall_s"]
    cpu = window["cpu_s"]
    return {
        "acquires_per_s": acquires / wall,
        "shard_cpus_busy": window["redis_cpus_busy_each"],
        "daemon_cpus_busy": window["daemon_cpus_busy_each"],
        "load_generator_cpus_busy": cpu["load_generator"] / wall,
        "machine_cpus_busy": cpu["machine_busy"] / wall,
        "others_cpu_s": cpu["others"],
        "wall_s": wall,
        "cpu_s": cpu,
        "evalsha": window["commandstats"].get("evalsha", {}),
    }


# -- the Redis-bound phase ----------------------------------------------------------------


def redis_round(
    nodes: list[RedisServer],
    owners: dict[str, int],
    commands: dict[str, list[str]],
    args: argparse.Namespace,
    load_cpus: list[int] | None,
) -> dict[str, Any]:
    processes = []
    for pool, command in commands.items():
        node = nodes[owners[pool]]
        processes.append(
            subprocess.Popen(
                [
                    "redis-benchmark",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(node.port),
                    "-c",
                    str(args.bench_clients),
                    "-P",
                    str(args.pipeline),
                    "-n",
                    "2000000000",
                    "-q",
                    *command,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        if load_cpus is not None:
            for process in processes:
                set_affinity(process.pid, set(load_cpus))
        time.sleep(1.0)  # connected and running
        meter = Meter(
            daemons=[],
            redis_ports=[node.port for node in nodes],
            redis_pids=[node.process.pid for node in nodes if node.process is not None],
        )
        meter.start([process.pid for process in processes])
        time.sleep(args.seconds)
        window = meter.stop(load_alive=True)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    evalsha = window["commandstats"].get("evalsha", {"calls": 0.0, "failed_calls": 0.0})
    if evalsha.get("failed_calls", 0.0):
        raise RuntimeError(f"EVALSHA calls failed in the window: {evalsha}")
    summary = round_summary(window, evalsha["calls"] * args.batch)
    summary["evalsha_per_s"] = evalsha["calls"] / window["wall_s"]
    summary["bound"] = bound(window, 0)
    return summary


# -- the end-to-end phase ----------------------------------------------------------------


def e2e_round(
    addresses: list[str],
    daemon_pids: list[int],
    nodes: list[RedisServer],
    bodies: dict[str, Path],
    args: argparse.Namespace,
) -> dict[str, Any]:
    commands = [
        h2load_command(
            address,
            ACQUIRE_PATH,
            body,
            clients=args.h2load_clients,
            streams=args.streams,
            seconds=args.seconds,
        )
        for address in addresses
        for body in bodies.values()
    ]
    meter = Meter(
        daemons=daemon_pids,
        redis_ports=[node.port for node in nodes],
        redis_pids=[node.process.pid for node in nodes if node.process is not None],
    )
    results, window = run_loads(commands, meter)
    assert window is not None
    succeeded = sum(r["succeeded"] for r in results)
    summary = round_summary(window, succeeded)
    summary["acquires_h2load"] = succeeded
    summary["acquires_per_evalsha"] = succeeded / max(
        1.0, window["commandstats"].get("evalsha", {}).get("calls", 0.0)
    )
    summary["bound"] = bound(window, len(daemon_pids))
    return summary


# -- the run -------------------------------------------------------------------------------


def median_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median throughput, whole (its CPU figures go with its rate)."""
    ordered = sorted(rounds, key=lambda r: float(r["acquires_per_s"]))
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, "acquires_per_s_each_round": [r["acquires_per_s"] for r in rounds]}


def print_round(phase: str, label: str, index: int, figures: dict[str, Any]) -> None:
    shards = ", ".join(f"{u:.0%}" for u in figures["shard_cpus_busy"])
    print(
        f"[{phase}] round {index + 1} {label:8s} {figures['acquires_per_s']:9.0f} Acquire/s; "
        f"shards {shards} of a core; daemons {sum(figures['daemon_cpus_busy']):.2f} CPUs; "
        f"machine {figures['machine_cpus_busy']:.2f} CPUs; load "
        f"{figures['load_generator_cpus_busy']:.2f} CPUs; others {figures['others_cpu_s']:.2f} "
        f"CPU-s; bound: {figures['bound']}"
    )


def main() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--pools-per-shard", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0, help="per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per cluster")
    parser.add_argument("--batch", type=int, default=8, help="Acquires per script call")
    parser.add_argument("--bench-clients", type=int, default=2, help="redis-benchmark -c, per pool")
    parser.add_argument("--pipeline", type=int, default=4, help="redis-benchmark -P")
    default_daemons = max(2, (len(cpus) - 3) * 2 // 3)
    parser.add_argument(
        "--daemons", type=int, default=default_daemons,
        help="qosd serve processes per cluster (default: %(default)s here, from the CPU count)",
    )  # fmt: skip
    parser.add_argument("--h2load-clients", type=int, default=1, help="per daemon and pool")
    parser.add_argument("--streams", type=int, default=16, help="per h2load connection")
    parser.add_argument("--pin", choices=("auto", "none"), default="auto")
    parser.add_argument("--phases", default="redis,e2e", help="redis, e2e or both")
    args = parser.parse_args()
    for tool in ("h2load", "redis-benchmark"):
        if shutil.which(tool) is None:
            print(f"{tool} is required (nghttp2-client, redis-tools)", file=sys.stderr)
            return 2
    phases = [phase.strip() for phase in args.phases.split(",")]
    layout = plan(cpus, args.shards, args.pin)
    labels = {1: "1 shard", args.shards: f"{args.shards} shards"}
    results: dict[str, Any] = {}

    with cluster(1) as single, cluster(args.shards) as sharded:
        clusters = {1: single, args.shards: sharded}
        owners = choose_pools(sharded, args.pools_per_shard)
        pools = list(owners)
        print(f"pools and their shard: {owners}")
        for nodes in clusters.values():
            for index, node in enumerate(nodes):
                assert node.process is not None
                if layout.shards is not None:
                    set_affinity(node.process.pid, {layout.shards[index]})
        own = {1: dict.fromkeys(pools, 0), args.shards: owners}

        if "redis" in phases:
            results["redis_bound"] = redis_phase(clusters, own, pools, args, layout, labels)
        if "e2e" in phases:
            results["end_to_end"] = e2e_phase(clusters, pools, args, layout, labels, cpus)

    results["setup"] = {
        "shards": args.shards,
        "pools": owners,
        "pools_per_shard": args.pools_per_shard,
        "seconds_per_round": args.seconds,
        "rounds": args.rounds,
        "layout": layout.note,
        "cpus": len(cpus),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "redis_server": redis_version(),
    }
    print_table(results, args.shards)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


Clusters = dict[int, list[RedisServer]]


def redis_phase(
    clusters: Clusters,
    own: dict[int, dict[str, int]],
    pools: list[str],
    args: argparse.Namespace,
    layout: Layout,
    labels: dict[int, str],
) -> dict[str, Any]:
    commands = {
        size: asyncio.run(capture_batches(nodes[0].url, pools, args.batch))
        for size, nodes in clusters.items()
    }
    for size, nodes in clusters.items():
        for pool, command in commands[size].items():
            check_replay(nodes[own[size][pool]].port, command, args.batch)
    rounds: dict[int, list[dict[str, Any]]] = {size: [] for size in clusters}
    for index in range(args.rounds):
        for size, nodes in clusters.items():
            figures = redis_round(nodes, own[size], commands[size], args, layout.load)
            rounds[size].append(figures)
            print_round("redis", labels[size], index, figures)
    result = phase_result(rounds, args.shards)
    result["command"] = {
        "arguments": len(commands[args.shards][pools[0]]),
        "batch": args.batch,
        "redis_benchmark": f"-c {args.bench_clients} -P {args.pipeline}, one per pool",
    }
    return result


def e2e_phase(
    clusters: Clusters,
    pools: list[str],
    args: argparse.Namespace,
    layout: Layout,
    labels: dict[int, str],
    cpus: list[int],
) -> dict[str, Any]:
    rounds: dict[int, list[dict[str, Any]]] = {size: [] for size in clusters}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        bodies = {}
        for pool in pools:
            bodies[pool] = Path(scratch, f"{pool}.bin")
            bodies[pool].write_bytes(grpc_frame(request_for(pool).SerializeToString()))
        daemons = {
            size: stack.enter_context(
                daemon_processes(daemon_config(nodes[0].url, pools), args.daemons)
            )
            for size, nodes in clusters.items()
        }
        for group in daemons.values():
            for daemon in group:
                assert daemon.process is not None
                for pool in pools:
                    check_one_acquire(daemon.address, request_for(pool))
                set_affinity(daemon.process.pid, set(layout.daemons or cpus))
        os.sched_setaffinity(0, set(layout.load or cpus))  # h2load inherits it
        try:
            for index in range(args.rounds):
                for size, nodes in clusters.items():
                    group = daemons[size]
                    figures = e2e_round(
                        [d.address for d in group],
                        [d.process.pid for d in group if d.process is not None],
                        nodes,
                        bodies,
                        args,
                    )
                    rounds[size].append(figures)
                    print_round("e2e", labels[size], index, figures)
        finally:
            os.sched_setaffinity(0, set(cpus))
    result = phase_result(rounds, args.shards)
    result["load"] = (
        f"{args.daemons} daemons per cluster; one h2load per daemon and pool "
        f"({args.daemons * len(pools)}), {args.h2load_clients} connection(s) x "
        f"{args.streams} streams each"
    )
    return result


def redis_version() -> str:
    output = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=True
    ).stdout
    return output.split("v=")[1].split()[0]


def phase_result(rounds: dict[int, list[dict[str, Any]]], shards: int) -> dict[str, Any]:
    one = median_summary(rounds[1])
    many = median_summary(rounds[shards])
    ratios = [
        b["acquires_per_s"] / a["acquires_per_s"]
        for a, b in zip(rounds[1], rounds[shards], strict=True)
    ]
    return {
        "one_shard": one,
        f"{shards}_shards": many,
        "ratio": many["acquires_per_s"] / one["acquires_per_s"],
        "ratio_each_round": ratios,
        "ratio_median_of_rounds": statistics.median(ratios),
        "bound_one_shard": one["bound"],
        f"bound_{shards}_shards": many["bound"],
    }


def print_table(results: dict[str, Any], shards: int) -> None:
    print()
    print(f"phase        1 shard Acq/s  {shards} shards Acq/s  ratio  shard CPU (1 / {shards})"
          "              machine CPUs (1 / n)")  # fmt: skip
    for name in ("redis_bound", "end_to_end"):
        if name not in results:
            continue
        phase = results[name]
        one, many = phase["one_shard"], phase[f"{shards}_shards"]
        print(
            f"{name:12s} {one['acquires_per_s']:13.0f}  {many['acquires_per_s']:14.0f}  "
            f"{phase['ratio']:5.2f}  "
            f"{'/'.join(f'{u:.0%}' for u in one['shard_cpus_busy'])} / "
            f"{'/'.join(f'{u:.0%}' for u in many['shard_cpus_busy'])}      "
            f"{one['machine_cpus_busy']:.2f} / {many['machine_cpus_busy']:.2f}"
        )
        print(f"  bound, 1 shard: {phase['bound_one_shard']}")
        print(f"  bound, {shards} shards: {phase[f'bound_{shards}_shards']}")


if __name__ == "__main__":
    raise SystemExit(main())
