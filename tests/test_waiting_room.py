"""Shared tokens, priorities, waiting, aging and tenant ceilings, on every backend.

Pools here are slow on purpose (1,000 tokens/s), so that the order of events does
not depend on a fast machine. Each test starts one daemon on the embedded store, a
standalone Redis or a 3-node Redis Cluster and talks to it over gRPC.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from qosd_client import AcquireResult, QosdClient, Reason, Status
from tests.conftest import DaemonFactory, RunningDaemon, merge
from tests.pace import worst_loop_lag_s
from tests.waiting import eventually

# Capacity 1,000 tokens/s; shared tokens hold 0.5 s of it (500). P0 refills at 600/s
# (burst 300), P1 at 300/s (burst 150), P2 at 100/s (burst 50). Every class borrows,
# and may be asked for up to 2,000 tokens at once.
SLOW_POOL: dict[str, Any] = {
    "pools": {"default": {"capacity_tokens_s": 1_000, "models": ["llama-3-8b"]}},
    "classes": {
        "P0": {"priority": 0, "share": 0.6, "max_wait_ms": 3_000, "can_borrow": True,
               "max_cost_tokens": 2_000},
        "P1": {"priority": 1, "share": 0.3, "max_wait_ms": 3_000, "can_borrow": True,
               "max_cost_tokens": 2_000},
        "P2": {"priority": 2, "share": 0.1, "max_wait_ms": 3_000, "can_borrow": True,
               "max_cost_tokens": 2_000},
    },
    "waiting": {"poll_ms": 5},
}  # fmt: skip


async def status(running: RunningDaemon) -> Any:
    admission = running.daemon.admission
    return await admission.store.status(admission.pool("default"))


async def queued(running: RunningDaemon, qos_class: str, count: int) -> int:
    """Waits until ``count`` requests of the class are in its queue; returns how many
    are (the caller asserts)."""
    now = await eventually(lambda: status(running), lambda s: s.classes[qos_class].waiting == count)
    return int(now.classes[qos_class].waiting)


async def test_borrowing_uses_capacity_another_class_leaves(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    began = time.monotonic()
    own = await qos.acquire("P2", 50, max_wait_ms=0)  # all of P2's own tokens
    borrowed = await qos.acquire("P2", 400, max_wait_ms=0)  # from the shared tokens
    assert own.admitted and borrowed.admitted
    after = await status(running)
    took = time.monotonic() - began
    # Plus what flowed in meanwhile: P0's and P1's refill (900 tokens/s) overflows
    # their full buckets into the shared tokens.
    assert 99 <= after.shared_tokens <= 500 - 400 + 900 * took + 1
    assert after.classes["P2"].tokens <= 5


async def test_a_class_share_is_never_borrowed(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    assert (await qos.acquire("P0", 800, max_wait_ms=0)).admitted  # own 300 + shared 500
    greedy = await qos.acquire("P0", 100, max_wait_ms=0)
    assert not greedy.admitted and greedy.reason is Reason.RATE_LIMITED
    floor = await qos.acquire("P1", 150, max_wait_ms=0)  # P1's whole share is still there
    assert floor.admitted


async def test_shared_tokens_go_to_the_higher_class_waiting(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    assert (await qos.acquire("P0", 800, max_wait_ms=0)).admitted  # P0 and shared empty
    # P0 waits for 600 tokens: its own refill (600/s) and the shared tokens, which
    # refill from the full P1 (300/s), cover it about 0.67 s from now.
    p0 = asyncio.create_task(qos.acquire("P0", 600, max_wait_ms=3_000))
    assert await queued(running, "P0", 1) == 1
    assert (await qos.acquire("P2", 50, max_wait_ms=0)).admitted  # P2's own floor: fine
    await asyncio.sleep(0.1)  # shared tokens accrue meanwhile, and P0 waits for them
    # P2 asks for more than its own refill (100/s) brings in 0.45 s, so only borrowing
    # the shared tokens could admit it, with margin on a slow machine.
    p2 = await qos.acquire("P2", 45, max_wait_ms=0)
    assert not p2.admitted and p2.reason is Reason.RATE_LIMITED
    first = await p0
    assert first.admitted and 0.1 < first.waited_s < 1.5


async def test_fifo_within_a_class(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    assert (await qos.acquire("P1", 650, max_wait_ms=0)).admitted  # P1 and shared empty
    order: list[str] = []

    async def request(name: str, cost: int) -> AcquireResult:
        result = await qos.acquire("P1", cost, max_wait_ms=3_000)
        order.append(name)
        return result

    big = asyncio.create_task(request("big", 300))
    assert await queued(running, "P1", 1) == 1  # "big" waits before "small" comes
    small = asyncio.create_task(request("small", 10))  # fits long before "big" does
    results = await asyncio.gather(big, small)
    assert all(result.admitted for result in results)
    assert order == ["big", "small"]


async def test_queue_bound_answers_queue_full(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(merge(SLOW_POOL, {"classes": {"P1": {"max_queue": 2}}}))
    qos = running.client
    assert (await qos.acquire("P1", 650, max_wait_ms=0)).admitted
    waiters = [asyncio.create_task(qos.acquire("P1", 300, max_wait_ms=3_000)) for _ in range(2)]
    assert await queued(running, "P1", 2) == 2
    full = await qos.acquire("P1", 10, max_wait_ms=3_000)
    assert not full.admitted and full.reason is Reason.QUEUE_FULL
    assert full.retry_after_s > 0
    assert all(result.admitted for result in await asyncio.gather(*waiters))


async def test_waiter_times_out_at_its_max_wait(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    # From a full bucket, 2,000 tokens put P2 20 s into debt: the head cannot go
    # before the test ends however slowly it runs (shared tokens hold 500 at most).
    assert (await qos.acquire("P2", 2_000, max_wait_ms=0)).admitted
    head = asyncio.create_task(qos.acquire("P2", 1_000, max_wait_ms=3_000))
    assert await queued(running, "P2", 1) == 1
    page = running.daemon.metrics.exposition().decode()
    behind = await qos.acquire("P2", 5, max_wait_ms=300)  # could fit, but FIFO
    assert not behind.admitted and behind.reason is Reason.QUEUE_TIMEOUT
    # Its max wait, less a poll, and at most a poll and the daemon's loop lag more
    # (its timers run late by that on a busy machine: tests.pace).
    lag_s = worst_loop_lag_s(running.daemon.metrics.exposition().decode(), page)
    assert 0.28 <= behind.waited_s <= 0.35 + lag_s
    # Told to come back after as long as it waited in the queue.
    assert 0.28 <= behind.retry_after_s <= behind.waited_s
    # Only the head is left: the timed-out entry is removed as it is answered.
    assert await queued(running, "P2", 1) == 1
    head.cancel()


async def test_hopeless_wait_is_refused_at_once(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    assert (await qos.acquire("P2", 550, max_wait_ms=0)).admitted
    # 1,500 tokens for P2 need well over a second even with every shared token.
    result = await qos.acquire("P2", 1_500, max_wait_ms=200)
    assert not result.admitted and result.reason is Reason.RATE_LIMITED
    # Refused without queueing (the daemon's own count of the time it waited), not
    # after its 200 ms; and told to come back after more than it would have waited.
    assert result.waited_s == 0 and result.retry_after_s > 0.2


# Every class is assured only 50 tokens/s, with a 100-second burst (5,000 tokens), so
# its own bucket stays empty once drained; the other 850 tokens/s of capacity are
# assured to nobody and refill the shared tokens. Waiters then compete for shared
# tokens only, which is where priority and aging decide.
SCARCE_POOL: dict[str, Any] = {
    "pools": {"default": {"capacity_tokens_s": 1_000, "models": ["llama-3-8b"]}},
    "classes": {
        name: {
            "priority": rank,
            "share": 0.05,
            "burst_s": 100,
            "max_wait_ms": 5_000,
            "can_borrow": True,
        }
        for rank, name in enumerate(("P0", "P1", "P2"))
    },
    "waiting": {"poll_ms": 5},
}


async def drain_scarce_pool(qos: QosdClient) -> None:
    for qos_class in ("P0", "P1", "P2"):
        assert (await qos.acquire(qos_class, 5_000, max_wait_ms=0)).admitted
    assert (await qos.acquire("P1", 500, max_wait_ms=0)).admitted  # the shared tokens


@pytest.mark.parametrize("aging_ms", [0, 100])
async def test_aging_lets_a_waiting_p2_go_first(make_daemon: DaemonFactory, aging_ms: int) -> None:
    running = await make_daemon(merge(SCARCE_POOL, {"classes": {"P2": {"aging_ms": aging_ms}}}))
    qos = running.client
    await drain_scarce_pool(qos)
    order: list[str] = []

    async def wait_for(qos_class: str) -> None:
        result = await qos.acquire(qos_class, 300, max_wait_ms=5_000)
        assert result.admitted, result
        order.append(qos_class)

    p2 = asyncio.create_task(wait_for("P2"))
    assert await queued(running, "P2", 1) == 1  # P2 waits first
    p1 = asyncio.create_task(wait_for("P1"))
    await asyncio.gather(p1, p2)
    # Without aging P1 outranks P2. With it, P2 (waiting ~350 ms when 300 shared tokens
    # have come in) has climbed to rank 0 and goes first.
    assert order == (["P2", "P1"] if aging_ms else ["P1", "P2"])


async def test_tenant_ceiling_keeps_one_tenant_from_taking_a_class(
    make_daemon: DaemonFactory,
) -> None:
    # P1 has 3,000 tokens/s here; one tenant may use 1 % of the pool: 100/s, burst 200
    # (2 s), slow enough that the steps below take a fraction of a refill on a busy
    # machine.
    ceiling = {"tenant_max_share": 0.01, "burst_s": 2, "max_wait_ms": 5_000}
    running = await make_daemon({"classes": {"P1": ceiling}})
    qos = running.client
    began = time.monotonic()
    assert (await qos.acquire("P1", 200, tenant="greedy", max_wait_ms=0)).admitted
    capped = await qos.acquire("P1", 200, tenant="greedy", max_wait_ms=0)
    took_s = time.monotonic() - began  # the ceiling refilled for no longer than this
    assert not capped.admitted and capped.reason is Reason.RATE_LIMITED
    # 200 tokens at the tenant's 100/s, less what came in between the two calls.
    assert 2 - took_s - 0.01 <= capped.retry_after_s <= 2.01
    assert (await qos.acquire("P1", 500, tenant="polite", max_wait_ms=0)).admitted
    greedy = asyncio.create_task(qos.acquire("P1", 200, tenant="greedy", max_wait_ms=5_000))
    assert await queued(running, "P1", 1) == 1  # queued, stepping aside for its tenant's ceiling
    # ... which does not hold up another tenant, even one that will not wait.
    assert (await qos.acquire("P1", 100, tenant="other", max_wait_ms=0)).admitted
    waited = await greedy
    assert waited.admitted and waited.waited_s > 0


async def test_status_shows_queues_and_the_worst_wait(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(SLOW_POOL)
    qos = running.client
    assert (await qos.acquire("P1", 650, max_wait_ms=0)).admitted
    began = time.monotonic()
    waiters = [asyncio.create_task(qos.acquire("P1", 400, max_wait_ms=3_000)) for _ in range(3)]
    assert await queued(running, "P1", 3) == 3
    await asyncio.sleep(max(0.0, began + 0.2 - time.monotonic()))  # the oldest waits 0.2 s
    now = (await qos.status()).pool("default")  # through the Admin service
    p1 = now.cls("P1")
    assert (p1.waiting, p1.waiting_here) == (3, 3)
    assert 0.15 <= p1.oldest_wait_s <= 0.6
    assert (p1.rate_tokens_s, p1.burst_tokens, p1.max_wait_s) == (300, 150, 3.0)
    assert now.cls("P0").waiting == 0 and now.cls("P0").oldest_wait_s == 0
    assert [c.name for c in now.classes] == ["P0", "P1", "P2"]
    assert now.capacity_tokens_s == 1_000 and now.shared_burst_tokens == 500
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)

    def p1_queue(now: Status) -> tuple[int, int]:
        p1 = now.pool("default").cls("P1")
        return p1.waiting, p1.waiting_here

    after = await eventually(lambda: qos.status("default"), lambda s: p1_queue(s) == (0, 0))
    assert p1_queue(after) == (0, 0)


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_waiters_on_two_daemons_share_one_queue(make_daemon: DaemonFactory) -> None:
    """Two daemons on one Redis: a P0 waiting on one goes before a P2 that arrives
    later at the other, although the P2 needs far fewer tokens."""
    first = await make_daemon(SCARCE_POOL)
    a = first.client
    b = (await make_daemon(SCARCE_POOL)).client  # same backend, same key prefix
    await drain_scarce_pool(a)
    order: list[str] = []

    async def wait_for(client: QosdClient, qos_class: str, cost: int) -> None:
        result = await client.acquire(qos_class, cost, max_wait_ms=3_000)
        assert result.admitted, result
        order.append(qos_class)

    p0 = asyncio.create_task(wait_for(a, "P0", 400))
    assert await queued(first, "P0", 1) == 1  # in the fleet-wide queue before the P2 comes
    p2 = asyncio.create_task(wait_for(b, "P2", 100))
    await asyncio.gather(p0, p2)
    # 100 shared tokens come in after ~0.12 s, 400 after ~0.47 s: without the fleet-wide
    # order the P2 would have gone first.
    assert order == ["P0", "P2"]
