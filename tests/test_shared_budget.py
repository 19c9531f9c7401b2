"""Exact shared budget: many daemon processes on one Redis admit, together, what one
bucket allows, no more and hardly less.

4 daemons run as separate processes; 200 concurrent clients in 2 worker processes
hammer one (pool, class) bucket through all of them for 10 s. Time bounds come from
the Redis server's own clock. With rate R and burst B, the tokens admitted over an
interval T of server time must satisfy  admitted <= B + R*T  (plus float slack), and
since demand exceeds the rate the whole time (refusals for the rate outnumber a
tenth of the admissions),  admitted >= 95 % of  B + R*W, where W is the span from
the workers' first ask to their last admission (tests.load.admission_window_s): T
also holds the workers' start and exit, which a busy machine stretches.
"""

from __future__ import annotations

import multiprocessing
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import redis
import redis.cluster

from qosd_harness import RedisCluster, RedisServer, daemon_processes
from tests.conftest import TEST_REDIS_TIMEOUT_MS
from tests.load import ClassLoadResult, admission_window_s, class_load, wait_for_workers

RATE = 10_000.0  # tokens/s for the hammered class (share 0.5 of 20,000)
BURST = 5_000.0  # 0.5 s of rate
COST = 20  # tokens per request: the bucket admits 500 requests/s
SECONDS = 10.0
CLIENTS = 200
WORKERS = 2
DAEMONS = 4


def redis_time(url: str, key: str | None = None) -> float:
    """TIME from the server, or, in a cluster, from the node that owns ``key``."""
    if key is None:
        client = redis.Redis.from_url(url)
        try:
            seconds, micros = client.time()
        finally:
            client.close()
    else:
        cluster = redis.cluster.RedisCluster.from_url(url)
        try:
            node = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
            seconds, micros = cluster.time(target_nodes=node)
        finally:
            cluster.close()
    return float(seconds) + micros / 1e6


def run_shared_budget(redis_settings: dict[str, Any], cluster: bool) -> None:
    url = redis_settings["url"]
    bucket_key = f"{redis_settings['key_prefix']}:{{default}}:bucket:P0" if cluster else None
    config = {
        "redis": redis_settings,
        "pools": {"default": {"capacity_tokens_s": 20_000}},
        "classes": {
            "P0": {"priority": 0, "share": 0.5, "burst_s": 0.5, "can_borrow": False},
            "P1": {"priority": 1, "share": 0.5},
        },
    }
    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    start, ready = manager.Event(), manager.Queue()
    with (
        daemon_processes(config, count=DAEMONS) as daemons,
        ProcessPoolExecutor(WORKERS, mp_context=context) as pool,
    ):
        addresses = [daemon.address for daemon in daemons]
        futures = [
            pool.submit(
                class_load, addresses, "P0", CLIENTS // WORKERS, SECONDS, COST, 0, start, ready
            )
            for _ in range(WORKERS)
        ]
        wait_for_workers(ready, futures)  # their interpreters are up: T starts now
        began = redis_time(url, bucket_key)
        start.set()
        results: list[ClassLoadResult] = [future.result(timeout=SECONDS + 60) for future in futures]
        ended = redis_time(url, bucket_key)

    elapsed = ended - began
    admitted = sum(r.tokens_admitted for r in results)
    answered = sum(r.answered for r in results)
    bound = BURST + RATE * elapsed
    floor = 0.95 * (BURST + RATE * admission_window_s(results))
    print(
        f"\n{DAEMONS} daemons, {CLIENTS} clients, {elapsed:.2f}s of Redis time: "
        f"{answered} answers ({answered / elapsed:.0f}/s), "
        f"{sum(r.admitted for r in results)} admitted = {admitted:.0f} tokens; "
        f"bound B+R*T = {bound:.0f}; admitted/bound = {admitted / bound:.4f}; "
        f"admitted over {admission_window_s(results):.2f} s; floor {floor:.0f}; "
        f"worst answer {max(r.worst_elapsed_s for r in results) * 1000:.0f} ms; "
        f"errors {sum(r.errors for r in results)}"
    )
    assert sum(r.errors for r in results) == 0
    reasons = {name: sum(r.reasons.get(name, 0) for r in results) for name in ("RATE_LIMITED",
               "BACKEND_UNAVAILABLE")}  # fmt: skip
    assert reasons["BACKEND_UNAVAILABLE"] == 0  # every answer was the bucket's
    # Demand must really exceed the rate, or the upper bound proves nothing: at least
    # one request in ten beyond what was admitted was refused for the rate (a count,
    # not a speed). Asking for twice the rate failed on a loaded CI machine, which
    # answered 867/s against the bucket's 500/s; 10 % still shows the bucket ran dry.
    assert reasons["RATE_LIMITED"] > 0.1 * sum(r.admitted for r in results)
    assert admitted <= bound + 1e-6 * bound
    assert admitted >= floor


@pytest.mark.slow
def test_shared_budget_standalone(redis_standalone: RedisServer) -> None:
    settings = {"url": redis_standalone.url, "key_prefix": f"t{uuid.uuid4().hex[:12]}",
                "timeout_ms": TEST_REDIS_TIMEOUT_MS}  # fmt: skip
    run_shared_budget(settings, cluster=False)


@pytest.mark.slow
def test_shared_budget_cluster(redis_cluster3: RedisCluster) -> None:
    settings = {
        "url": redis_cluster3.url,
        "mode": "cluster",
        "key_prefix": f"t{uuid.uuid4().hex[:12]}",
        "timeout_ms": TEST_REDIS_TIMEOUT_MS,  # 100 ms timed out on a loaded machine
    }
    run_shared_budget(settings, cluster=True)
