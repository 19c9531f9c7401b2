"""Leases in flight: counted by the scripts that change them, on every backend.

A lease counts from its admission (at once, or by the waiting room's pump) until it
is released, or until the second of store time its expiry falls in has passed. The
counts and their prompt plus expected output tokens (KV) are kept per class in the
pool's state, so GetStatus (and /metrics, and qosctl) reads them in O(classes), never
O(leases).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from qosd_client import DuplicateRequestId, QosdClient
from qosd_harness import RedisCluster, RedisServer, daemon_processes
from tests.conftest import TEST_REDIS_TIMEOUT_MS, DaemonFactory, merge


async def _flight(qos: QosdClient) -> dict[str, tuple[int, float]]:
    pool = (await qos.status("default")).pool("default")
    return {c.name: (c.in_flight, c.in_flight_tokens) for c in pool.classes}


async def test_admissions_count_until_released(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    p0 = [await qos.acquire("P0", 100 * (n + 1), max_wait_ms=0) for n in range(3)]
    p2 = await qos.acquire("P2", 250, max_wait_ms=0)
    assert all(lease.admitted for lease in [*p0, p2])
    assert await _flight(qos) == {"P0": (3, 600.0), "P1": (0, 0.0), "P2": (1, 250.0)}

    # A release ends the lease at its estimate, whatever it settles to.
    await qos.release(p0[1].lease_id, input_tokens=5)
    assert await _flight(qos) == {"P0": (2, 400.0), "P1": (0, 0.0), "P2": (1, 250.0)}
    again = await qos.release(p0[1].lease_id, input_tokens=5)
    assert again.already_released
    assert (await _flight(qos))["P0"] == (2, 400.0)  # no second decrement

    # A repeated request id is refused as a duplicate: no second lease in flight.
    first = await qos.acquire("P1", 300, max_wait_ms=0, request_id="r-1")
    with pytest.raises(DuplicateRequestId):
        await qos.acquire("P1", 300, max_wait_ms=0, request_id="r-1")
    assert (await _flight(qos))["P1"] == (1, 300.0)

    for lease in (p0[0], p0[2], p2, first):
        await qos.release(lease.lease_id)
    assert await _flight(qos) == {"P0": (0, 0.0), "P1": (0, 0.0), "P2": (0, 0.0)}
    assert (await qos.status("default")).pool("default").active_leases == 0


async def test_a_waiter_counts_once_admitted(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    drained = await qos.acquire("P2", 500, max_wait_ms=0)  # P2's whole burst
    assert drained.admitted
    # Queued, then admitted by the pump once P2 refilled 200 tokens at 1,000/s.
    result = await qos.acquire("P2", 200, max_wait_ms=3_000)
    assert result.admitted and result.waited_s > 0
    assert (await _flight(qos))["P2"] == (2, 700.0)


async def test_leases_never_released_stop_counting_after_their_ttl(
    make_daemon: DaemonFactory,
) -> None:
    qos = (await make_daemon({"lease": {"ttl_s": 0.2}})).client
    for qos_class, cost in (("P0", 100), ("P1", 200), ("P1", 300)):
        assert (await qos.acquire(qos_class, cost, max_wait_ms=0)).admitted
    assert await _flight(qos) == {"P0": (1, 100.0), "P1": (2, 500.0), "P2": (0, 0.0)}
    deadline = time.monotonic() + 3.0  # the TTL, then at most the second it ends in
    while (await qos.status("default")).pool("default").active_leases:
        assert time.monotonic() < deadline, await _flight(qos)
        await asyncio.sleep(0.05)
    assert await _flight(qos) == {"P0": (0, 0.0), "P1": (0, 0.0), "P2": (0, 0.0)}
    # A later lease counts from zero, not from what expired.
    assert (await qos.acquire("P2", 50, max_wait_ms=0)).admitted
    assert (await _flight(qos))["P2"] == (1, 50.0)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["redis", "cluster"])
async def test_in_flight_is_exact_across_four_daemons(
    topology: str, request: pytest.FixtureRequest
) -> None:
    """Four daemon processes on one store, 32 clients acquiring and releasing at
    random (some never release, some release twice): once quiet, every daemon reports
    exactly the leases the clients hold, and their tokens."""
    if topology == "redis":
        server: RedisServer = request.getfixturevalue("redis_standalone")
        redis: dict[str, Any] = {"url": server.url, "mode": "standalone"}
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster3")
        redis = {"url": cluster.url, "mode": "cluster"}
    redis["key_prefix"] = f"flight-{topology}-{random.randrange(1 << 30):x}"
    redis["timeout_ms"] = TEST_REDIS_TIMEOUT_MS
    tree = merge(
        {
            "pools": {"default": {"capacity_tokens_s": 1_000_000}},
            "classes": {
                "P0": {"priority": 0, "share": 0.6, "max_wait_ms": 0},
                "P1": {"priority": 1, "share": 0.3, "max_wait_ms": 0},
                "P2": {"priority": 2, "share": 0.1, "max_wait_ms": 0},
            },
        },
        {"redis": redis},
    )
    held: dict[str, tuple[str, float]] = {}  # lease id -> (class, charge)
    chooser = random.Random(12)
    with daemon_processes(tree, count=4) as daemons:
        clients = [QosdClient(daemon.address) for daemon in daemons]
        try:

            async def worker(index: int) -> None:
                qos = clients[index % len(clients)]
                rng = random.Random(index)
                mine: list[str] = []
                for _ in range(40):
                    if mine and rng.random() < 0.45:
                        lease_id = mine.pop(rng.randrange(len(mine)))
                        await qos.release(lease_id, input_tokens=rng.randrange(1, 50))
                        del held[lease_id]
                        if rng.random() < 0.2:  # a retried release changes nothing
                            await qos.release(lease_id)
                        continue
                    qos_class = rng.choice(("P0", "P1", "P2"))
                    result = await qos.acquire(qos_class, rng.randrange(1, 400), max_wait_ms=0)
                    if result.admitted:
                        mine.append(result.lease_id)
                        held[result.lease_id] = (qos_class, result.tokens_charged)

            await asyncio.gather(*(worker(n) for n in range(32)))
            expected = {name: [0, 0.0] for name in ("P0", "P1", "P2")}
            for qos_class, charge in held.values():
                expected[qos_class][0] += 1
                expected[qos_class][1] += charge
            assert sum(count for count, _ in expected.values()) > 50  # some are held
            for qos in clients:  # every daemon reads the same fleet-wide counts
                flight = await _flight(qos)
                for name, (count, charge) in expected.items():
                    assert flight[name][0] == count
                    assert flight[name][1] == pytest.approx(charge)
            # Release the rest from other daemons than the ones that admitted them.
            leases = list(held)
            chooser.shuffle(leases)
            for n, lease_id in enumerate(leases):
                await clients[n % len(clients)].release(lease_id)
            for qos in clients:
                assert await _flight(qos) == {"P0": (0, 0.0), "P1": (0, 0.0), "P2": (0, 0.0)}
        finally:
            for qos in clients:
                await qos.close()
