"""What the acquire script costs Redis, per call and per Acquire, at set batch sizes.

    python benchmarks/script_cost.py --json results/script_cost.json

The decision benchmark (benchmarks/decisions.py) measures Redis's time per Acquire
under a daemon's real load, where the batch size is whatever the daemon's speed makes
it. This one isolates the script: it starts its own redis-server and drives
``RedisStore.acquire`` from one process, ``--batches`` at a time (so each EVALSHA
carries that many Acquires), every Acquire admitted, and reads Redis's own figures
over each round: ``INFO commandstats`` (time inside EVALSHA, everything the script
issues included) and redis-server's CPU (``/proc``: reading, parsing and replying on
the socket too). Per call and per Acquire, median of ``--rounds`` alternating rounds.

Fitting ``usec = fixed + per_request x batch`` over the batch sizes splits the
script's cost into what each call pays whatever it carries (policy, state read and
write, the prelude) and what each request adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import uvloop

from qosd.config import Config
from qosd.model import LeaseSpec, new_lease_token
from qosd.policy import resolve_pools
from qosd.store.redis import RedisStore
from qosd_harness import redis_command, redis_server

CONFIG: dict[str, Any] = {
    "pools": {"default": {"capacity_tokens_s": 1e9}},  # everything admitted
    "lease": {"ttl_s": 300},
    "cost": {"output_weight": 1.0},  # an Acquire of 100 + 50 tokens costs 150
}


def evalsha_stats(port: int) -> tuple[float, float]:
    """(calls, usec) of EVALSHA in INFO commandstats."""
    for line in str(redis_command(port, "INFO", "commandstats")).splitlines():
        if line.startswith("cmdstat_evalsha:"):
            fields = dict(item.split("=") for item in line.split(":", 1)[1].split(","))
            return float(fields["calls"]), float(fields["usec"])
    return 0.0, 0.0


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(
    store: RedisStore, port: int, pid: int, batch: int, acquires: int
) -> dict[str, float]:
    pool = resolve_pools(Config.model_validate(CONFIG))["default"]
    cls = pool.classes[1]

    def lease() -> LeaseSpec:
        token = new_lease_token()
        return LeaseSpec(f"default:{cls.name}:{token}", "", "tenant", 100, 50, 1.0, 300_000)

    # Warm: the scripts are loaded and the state exists.
    await store.acquire(pool, cls, lease(), 0)
    redis_command(port, "CONFIG", "RESETSTAT")
    cpu_before = process_cpu_s(pid)
    started = time.perf_counter()
    done = 0
    while done < acquires:
        # Calls submitted in one turn of the loop, with nothing in flight, go as one
        # script call (qosd/store/batching.py).
        decisions = await asyncio.gather(
            *(store.acquire(pool, cls, lease(), 0) for _ in range(batch))
        )
        assert all(decision.admitted for decision in decisions), decisions[0]
        done += len(decisions)
    elapsed = time.perf_counter() - started
    cpu = process_cpu_s(pid) - cpu_before
    calls, usec = evalsha_stats(port)
    return {
        "batch": done / calls,
        "calls": calls,
        "acquires": done,
        "usec_per_call": usec / calls,
        "usec_per_acquire": usec / done,
        "cpu_us_per_call": cpu * 1e6 / calls,
        "cpu_us_per_acquire": cpu * 1e6 / done,
        "seconds": elapsed,
    }


async def measure(batches: list[int], acquires: int, rounds: int) -> dict[str, Any]:
    config = Config.model_validate(CONFIG)
    results: dict[int, list[dict[str, float]]] = {batch: [] for batch in batches}
    with redis_server() as server:
        assert server.process is not None
        merged = {**CONFIG, "redis": {"url": server.url, "timeout_ms": 5_000}}
        config = Config.model_validate(merged)
        store = RedisStore(config.redis, tombstone_ms=1_000, lease_ttl_ms=300_000)
        await store.start()
        try:
            for round_index in range(rounds):
                for batch in batches:
                    figures = await one_round(
                        store, server.port, server.process.pid, batch, acquires
                    )
                    results[batch].append(figures)
                    print(
                        f"round {round_index + 1} batch {figures['batch']:5.1f}: "
                        f"{figures['usec_per_call']:7.1f} µs a call, "
                        f"{figures['usec_per_acquire']:6.1f} µs an Acquire (commandstats); "
                        f"CPU {figures['cpu_us_per_acquire']:6.1f} µs an Acquire",
                        flush=True,
                    )
        finally:
            await store.close()
    summary = {
        str(batch): {
            key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "seconds"
        }
        for batch, rows in results.items()
    }
    xs = [summary[str(b)]["batch"] for b in batches]
    ys = [summary[str(b)]["usec_per_call"] for b in batches]
    fit: dict[str, float] = {}
    if len(xs) >= 2:
        slope, intercept = statistics.linear_regression(xs, ys)
        fit = {"fixed_usec_per_call": intercept, "usec_per_request": slope}
    return {"by_batch": summary, "fit": fit, "rounds": {str(b): r for b, r in results.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,16,64", help="Acquires per script call")
    parser.add_argument("--acquires", type=int, default=3_000, help="per round and batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = uvloop.run(measure(batches, args.acquires, args.rounds))
    fit = results["fit"]
    print("\nbatch  µs/call  µs/Acquire  CPU µs/Acquire")
    for row in results["by_batch"].values():
        print(
            f"{row['batch']:5.1f}  {row['usec_per_call']:7.1f}  {row['usec_per_acquire']:10.1f}"
            f"  {row['cpu_us_per_acquire']:14.1f}"
        )
    if fit:
        print(
            f"fit: {fit['fixed_usec_per_call']:.1f} µs a call + "
            f"{fit['usec_per_request']:.1f} µs a request"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
