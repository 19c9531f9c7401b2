"""What many tenants leave in Redis under fair shares by tokens, and what a status
scrape costs beside them.

    python benchmarks/tenant_state.py --tenants 100000 --json docs/results/tenant_state.json

Starts a Redis, and through ``RedisStore`` (one process, many Acquires per script
call, as a daemon sends them) admits one request for each of ``--tenants`` distinct
tenants in a class with ``fairness: vtc`` and ``fairness.idle_s`` of ``--idle-s``.
It reports the keys and memory Redis holds after that (INFO keyspace, used_memory),
then runs ``--scrapes`` status calls with SLOWLOG recording every command of 5 ms or
more, and reads how long the tenant counters take to leave once their tenants are
idle (polled each 100 ms). Every counter is a key with its own expiry, so no scan runs, and a
status call reads the pool's state hash only, whatever the number of tenants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from qosd.config import Config
from qosd.model import LeaseSpec
from qosd.policy import lease_token, resolve_pools
from qosd.store.redis import RedisStore
from qosd_harness import redis_command, redis_server, source_commit

SLOW_US = 5_000


def info(port: int, section: str) -> dict[str, str]:
    fields = {}
    for line in str(redis_command(port, "INFO", section)).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


def key_count(port: int) -> int:
    return int(redis_command(port, "DBSIZE"))


def counter_keys(port: int) -> int:
    """Tenant counters in Redis (SCAN; a benchmark may, qosd never does)."""
    cursor, found = "0", 0
    while True:
        cursor, keys = redis_command(port, "SCAN", cursor, "MATCH", "*:vtc:*", "COUNT", "10000")
        found += len(keys)
        if cursor == "0":
            return found


async def until_gone(port: int, limit_s: float) -> int:
    """Polls the tenant counters each 100 ms until none is left (or the limit passes);
    how many are left then."""
    deadline = time.perf_counter() + limit_s
    count = counter_keys(port)
    while count and time.perf_counter() < deadline:
        await asyncio.sleep(0.1)
        count = counter_keys(port)
    return count


async def measure(tenants: int, idle_s: float, scrapes: int, batch: int) -> dict[str, Any]:
    tree: dict[str, Any] = {
        "pools": {"default": {"capacity_tokens_s": 1e9}},  # every request admitted
        "classes": {"P1": {"priority": 1, "share": 0.35, "fairness": "vtc"}},
        "fairness": {"idle_s": idle_s},
        "lease": {"ttl_s": 1},
    }
    with redis_server() as server:
        config = Config.model_validate({**tree, "redis": {"url": server.url, "timeout_ms": 10_000}})
        pool = resolve_pools(config)["default"]
        p1 = next(c for c in pool.classes if c.name == "P1")
        store = RedisStore(config.redis, tombstone_ms=1_000, lease_ttl_ms=1_000)
        await store.start()
        try:
            await store.status(pool)
            before = key_count(server.port)
            memory_before = int(info(server.port, "memory")["used_memory"])
            started = time.perf_counter()
            for first in range(0, tenants, batch):
                specs = [
                    LeaseSpec(f"default:P1:{lease_token(p1, name)}", "", name, 10, 0, 1.0, 1_000)
                    for name in (f"t{n}" for n in range(first, min(tenants, first + batch)))
                ]
                decisions = await asyncio.gather(
                    *(store.acquire(pool, p1, spec, 0) for spec in specs)
                )
                assert all(d.admitted for d in decisions)
            last_charge = time.perf_counter()
            admitted_s = last_charge - started
            keys = key_count(server.port)
            counters = counter_keys(server.port)
            memory = int(info(server.port, "memory")["used_memory"])
            redis_command(server.port, "CONFIG", "SET", "slowlog-log-slower-than", str(SLOW_US))
            redis_command(server.port, "SLOWLOG", "RESET")
            redis_command(server.port, "CONFIG", "RESETSTAT")
            for _ in range(scrapes):
                await store.status(pool)
            slow = redis_command(server.port, "SLOWLOG", "GET", "128")
            stats = info(server.port, "commandstats").get("cmdstat_evalsha", "")
            fields = dict(item.split("=") for item in stats.split(",")) if stats else {}
            left = await until_gone(server.port, idle_s + 30)
            gone_s = time.perf_counter() - last_charge
        finally:
            await store.close()
    return {
        "tenants": tenants,
        "idle_s": idle_s,
        "admitted_s": round(admitted_s, 1),
        "keys_before": before,
        "keys_after_admitting": keys,
        "tenant_counters": counters,
        "memory_mb_added": round((memory - memory_before) / 2**20, 1),
        "status_calls": scrapes,
        "status_usec_per_call": float(fields.get("usec_per_call", 0)),
        "commands_of_5ms_or_more": len(slow) if isinstance(slow, list) else 0,
        "tenant_counters_left_after_idle": left,
        "seconds_from_the_last_charge_until_gone": round(gone_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=100_000)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--scrapes", type=int, default=100)
    parser.add_argument("--batch", type=int, default=500, help="Acquires in flight at once")
    parser.add_argument("--json", default="tenant_state.json")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.tenants, args.idle_s, args.scrapes, args.batch))
    figures["commit"] = source_commit(Path(__file__).resolve().parents[1])
    figures["command"] = (
        f"benchmarks/tenant_state.py --tenants {args.tenants} --idle-s {args.idle_s:g} "
        f"--scrapes {args.scrapes} --batch {args.batch}"
    )
    Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
