"""GPU-gated pools: admission by what the servers can take, in the buckets' order.

A pool with ``max_in_flight`` (requests) or ``max_in_flight_tokens`` (charges) admits
while its leases in flight stay within the bound, and is work-conserving inside it:
a class short of tokens is admitted over its share when nobody of better standing
waits. When the bound is reached, requests wait, and the next free slot goes to the
best standing: within its share before over it, then by rank (with aging), then by
arrival. Run on the embedded store, a standalone Redis and a 3-node cluster.

Rates (tests/conftest.py): P0 6,000/s (burst 3,000), P1 3,000/s (burst 1,500), P2
1,000/s (burst 500), no borrowing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from qosd.model import PrefillLearned
from qosd_client import QosdClient, Reason
from tests.conftest import DaemonFactory

# No reserve for the top class here, so that counts are exact: tested on its own.
GATED: dict[str, Any] = {"pools": {"default": {"max_in_flight": 3, "top_reserve": 0}}}
# Waits long enough that only the slots decide who is admitted: the conftest's classes
# wait 200 ms to 5 s, which a busy machine can use up between two steps of a test.
PATIENT: dict[str, Any] = {
    **GATED,
    "classes": {name: {"max_wait_ms": 30_000} for name in ("P0", "P1", "P2")},
}


async def _in_flight(qos: QosdClient) -> int:
    return (await qos.status("default")).pool("default").active_leases


async def _waiting(qos: QosdClient, qos_class: str) -> int:
    return (await qos.status("default")).pool("default").cls(qos_class).waiting


async def _until_waiting(qos: QosdClient, qos_class: str, count: int) -> None:
    deadline = time.monotonic() + 20.0
    while await _waiting(qos, qos_class) != count:
        assert time.monotonic() < deadline, f"{qos_class} never had {count} waiting"
        await asyncio.sleep(0.01)


async def test_room_admits_a_class_over_its_share(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon(GATED)).client
    began = time.monotonic()
    within = await qos.acquire("P2", 500, max_wait_ms=0)  # P2's whole burst
    assert within.admitted and within.remaining_tokens == pytest.approx(0, abs=1)
    # Nothing waits and the servers have room: over its share, into debt...
    over = await qos.acquire("P2", 400, max_wait_ms=0)
    took = time.monotonic() - began
    # ... less what P2 refilled (1,000 tokens/s) between the two, which took no longer
    # than both calls (on a loaded machine, tens of milliseconds).
    assert over.admitted and -401 <= over.remaining_tokens <= -400 + 1_000 * took + 1
    # ... never below minus one burst.
    deeper = await qos.acquire("P2", 400, max_wait_ms=0)
    assert deeper.admitted and deeper.remaining_tokens == pytest.approx(-500, abs=1)
    # The bound of 3 in flight holds, whatever the buckets hold.
    full = await qos.acquire("P0", 10, max_wait_ms=0)
    assert not full.admitted and full.reason is Reason.RATE_LIMITED
    assert full.retry_after_s > 0
    assert await _in_flight(qos) == 3


async def test_a_release_frees_room_for_a_waiter(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon(PATIENT)).client
    leases = [await qos.acquire("P0", 100, max_wait_ms=0) for _ in range(3)]
    waiter = asyncio.create_task(qos.acquire("P1", 100, max_wait_ms=30_000))
    await _until_waiting(qos, "P1", 1)
    await qos.release(leases[0].lease_id)  # refunds nothing, but frees a slot
    result = await waiter
    assert result.admitted  # nothing else would free a slot within its 30 s
    assert await _in_flight(qos) == 3


# P0 refills at 10 tokens/s from a 3,000-token burst: once drained, its 500-token
# waiter stays over its share for 50 s, however slowly the machine takes the test's
# steps (at the conftest's 6,000/s it was within again after 83 ms, and took the
# slot from P1 on a busy machine).
SLOW_P0: dict[str, Any] = {
    **PATIENT,
    "classes": {
        **PATIENT["classes"],
        "P0": {"max_wait_ms": 30_000, "share": 0.001, "burst_tokens": 3_000},
    },
}


async def test_the_next_slot_goes_within_share_first(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon(SLOW_P0)).client
    p0 = [await qos.acquire("P0", 1000, max_wait_ms=0) for _ in range(3)]  # P0's burst
    assert all(lease.admitted for lease in p0)
    # A P0 waiter over its share arrives first, then a P1 waiter within its share.
    over = asyncio.create_task(qos.acquire("P0", 500, max_wait_ms=30_000))
    await _until_waiting(qos, "P0", 1)
    within = asyncio.create_task(qos.acquire("P1", 500, max_wait_ms=30_000))
    await _until_waiting(qos, "P1", 1)
    await qos.release(p0[0].lease_id, input_tokens=1000)
    first = await within
    assert first.admitted
    assert not over.done() and await _waiting(qos, "P0") == 1  # one slot, one winner
    await qos.release(p0[1].lease_id, input_tokens=1000)
    second = await over
    assert second.admitted


async def test_the_token_bound_lets_a_lone_request_through(make_daemon: DaemonFactory) -> None:
    qos = (
        await make_daemon(
            {
                "pools": {"default": {"max_in_flight_tokens": 2_000, "top_reserve": 0}},
                "classes": {"P1": {"max_cost_tokens": 6_000}},
            }
        )
    ).client
    big = await qos.acquire("P1", 5_000, max_wait_ms=0)  # above the bound, but alone
    assert big.admitted
    small = await qos.acquire("P0", 10, max_wait_ms=0)
    assert not small.admitted and small.reason is Reason.RATE_LIMITED
    await qos.release(big.lease_id)
    fits = [await qos.acquire("P0", 900, max_wait_ms=0) for _ in range(2)]
    assert all(lease.admitted for lease in fits)
    assert not (await qos.acquire("P0", 300, max_wait_ms=0)).admitted  # 1,800 + 300


async def test_cuts_shrink_the_bound(make_daemon: DaemonFactory) -> None:
    gated = {"pools": {"default": {"max_in_flight": 4, "top_reserve": 0}}}
    running = await make_daemon(gated)
    qos, admin = running.client, running.admin
    await admin.pin_rate("default", 5_000)  # half the configured rate: half the bound
    two = [await qos.acquire("P0", 10, max_wait_ms=0) for _ in range(2)]
    assert all(lease.admitted for lease in two)
    assert not (await qos.acquire("P0", 10, max_wait_ms=0)).admitted
    await admin.unpin_rate("default")
    await admin.pin_rate("default", 20_000)  # growth never lifts it above the servers'
    more = [await qos.acquire("P0", 10, max_wait_ms=0) for _ in range(2)]
    assert all(lease.admitted for lease in more)
    assert not (await qos.acquire("P0", 10, max_wait_ms=0)).admitted


@pytest.mark.slow
async def test_work_conservation_under_waiters(make_daemon: DaemonFactory) -> None:
    """Demand at three times the pool's rate, in requests larger than any burst: the
    pool admits at least 95 % of its rate R for as long as requests wait."""
    rate = 10_000.0
    qos = (
        await make_daemon(
            {
                "pools": {"default": {"max_in_flight": 64}},
                "classes": {
                    name: {"max_wait_ms": 1_000, "max_cost_tokens": 4_000}
                    for name in ("P0", "P1", "P2")
                },
            }
        )
    ).client
    admitted = 0.0
    stop = time.monotonic() + 2.0
    releases: list[asyncio.Task[None]] = []

    async def release_later(lease_id: str) -> None:
        await asyncio.sleep(0.2)  # the request's service time, in this test's model
        await qos.release(lease_id)

    async def caller(qos_class: str) -> None:
        nonlocal admitted
        while time.monotonic() < stop:
            result = await qos.acquire(qos_class, 4_000, max_wait_ms=1_000)
            if result.admitted:
                admitted += result.tokens_charged
                releases.append(asyncio.create_task(release_later(result.lease_id)))

    started = time.monotonic()
    await asyncio.gather(*(caller(("P0", "P1", "P2")[n % 3]) for n in range(12)))
    elapsed = time.monotonic() - started
    await asyncio.gather(*releases)
    assert admitted >= 0.95 * rate * elapsed


async def test_debt_counts_the_share_but_room_is_forgiven(make_daemon: DaemonFactory) -> None:
    """Within its share, a request above the burst carries its whole debt (so a class
    of large requests gets its share, not one request per refill); admitted over its
    share, on room nobody else wanted, a class owes at most one burst."""
    extra = {**GATED, "classes": {"P1": {"max_cost_tokens": 6_000}}}
    qos = (await make_daemon(extra)).client
    long = await qos.acquire("P1", 5_000, max_wait_ms=0)  # from a full bucket
    assert long.admitted and long.remaining_tokens == pytest.approx(1_500 - 5_000, abs=50)
    began = time.monotonic()
    over = await qos.acquire("P2", 500, max_wait_ms=0)  # P2's whole burst: within
    again = await qos.acquire("P2", 400, max_wait_ms=0)  # over its share, on room
    took = time.monotonic() - began
    assert over.admitted and again.admitted
    # Less P2's refill (1,000 tokens/s) between the two calls.
    assert -401 <= again.remaining_tokens <= -400 + 1_000 * took + 1


async def test_aging_never_outranks_a_higher_class(make_daemon: DaemonFactory) -> None:
    """Where the servers' room is the one thing contested, a P2 waiter aged past P0's
    rank still goes after the P0 and P1 waiters over their shares: aging promotes it
    to P1's rank at most, and between equal ranks the higher class goes first (its
    progress comes from its floor). Rates are near zero (6, 3 and 1 tokens/s), so
    every waiter stays over its share. No reserve for P0, fixed or following its peak
    (tests/test_top_reserve.py): the order is the subject here."""
    bursts = {"P0": 30, "P1": 15, "P2": 5}
    pool = {
        "capacity_tokens_s": 10,
        "max_in_flight": 3,
        "top_reserve": 0,
        "top_reserve_half_life_s": 0,
    }
    extra = {
        "pools": {"default": pool},
        "classes": {
            name: {"burst_tokens": burst, **({"aging_ms": 50} if name == "P2" else {})}
            for name, burst in bursts.items()
        },
    }
    qos = (await make_daemon(extra)).client
    held = [await qos.acquire(name, burst, max_wait_ms=0) for name, burst in bursts.items()]
    assert all(lease.admitted for lease in held)  # every bucket drained, no room left
    aged = asyncio.create_task(qos.acquire("P2", 5, max_wait_ms=4_000))
    await _until_waiting(qos, "P2", 1)
    await asyncio.sleep(0.2)  # aging: four ranks' worth, so it would pass P0
    p1 = asyncio.create_task(qos.acquire("P1", 15, max_wait_ms=4_000))
    await _until_waiting(qos, "P1", 1)
    p0 = asyncio.create_task(qos.acquire("P0", 30, max_wait_ms=4_000))
    await _until_waiting(qos, "P0", 1)
    await qos.release(held[0].lease_id)
    assert (await p0).admitted
    assert not aged.done() and not p1.done()
    await qos.release(held[1].lease_id)
    assert (await p1).admitted
    assert not aged.done()
    await qos.release(held[2].lease_id)
    assert (await aged).admitted


async def test_the_top_class_keeps_a_reserve(make_daemon: DaemonFactory) -> None:
    """Classes below the top one leave ``top_reserve`` of the bound to it: a P0
    request finds room at once where a P1 request would wait."""
    extra = {"pools": {"default": {"max_in_flight": 10, "top_reserve": 0.2}}}
    qos = (await make_daemon(extra)).client
    lower = [await qos.acquire("P1", 10, max_wait_ms=0) for _ in range(8)]
    assert all(lease.admitted for lease in lower)
    assert not (await qos.acquire("P2", 10, max_wait_ms=0)).admitted  # 9 > 10 x 0.8
    top = [await qos.acquire("P0", 10, max_wait_ms=0) for _ in range(2)]
    assert all(lease.admitted for lease in top)
    assert not (await qos.acquire("P0", 10, max_wait_ms=0)).admitted  # the bound itself


async def test_a_lower_waiter_without_room_leaves_the_reserve_to_the_top_class(
    make_daemon: DaemonFactory,
) -> None:
    """A waiter without room holds the pool's room, but not the top class's reserve,
    which it could not use: a P0 request over its share goes past a P1 waiter within
    its share into the reserve, at Acquire and when a release frees room only the top
    class may take. Rates are near zero (6, 3 and 1 tokens/s), so no bucket refills."""
    bursts = {"P0": 30, "P1": 15, "P2": 5}
    extra = {
        "pools": {"default": {"capacity_tokens_s": 10, "max_in_flight": 5, "top_reserve": 0.2}},
        "classes": {name: {"burst_tokens": burst} for name, burst in bursts.items()},
    }
    qos = (await make_daemon(extra)).client
    assert (await qos.acquire("P0", 30, max_wait_ms=0)).admitted  # P0 now over its share
    lower = [await qos.acquire("P2", 1, max_wait_ms=0) for _ in range(3)]
    assert all(lease.admitted for lease in lower)  # 4 in flight: the lower classes' 5 x 0.8
    p1 = asyncio.create_task(qos.acquire("P1", 15, max_wait_ms=4_000))  # within its share
    await _until_waiting(qos, "P1", 1)
    passed = await qos.acquire("P0", 30, max_wait_ms=2_000)
    assert passed.admitted and passed.reason is Reason.NONE  # into the reserve, past P1
    second = asyncio.create_task(qos.acquire("P0", 30, max_wait_ms=4_000))  # 5 of 5: waits
    await _until_waiting(qos, "P0", 1)
    await qos.release(lower[0].lease_id)  # 4 in flight: room for P0 alone
    assert (await second).admitted
    assert not p1.done() and await _waiting(qos, "P1") == 1
    await qos.release(lower[1].lease_id)
    await qos.release(lower[2].lease_id)  # 3 in flight: room for P1 again
    assert (await p1).admitted


async def test_the_prefill_backlog_bounds_admission(make_daemon: DaemonFactory) -> None:
    """With a prefill model (here 10 ms per prompt token), a GPU-gated pool admits
    while the prompts admitted would be prefilled within max_prefill_backlog_ms (1 s),
    so later requests wait in qosd, in priority order, rather than at the servers.
    Seconds, not milliseconds: the calls' own time, long on a busy machine, is then
    small beside the wait."""
    pool = {"max_in_flight": 100, "max_prefill_backlog_ms": 1_000, "max_prefill_share": 1.0}
    extra = {
        "pools": {"default": pool},
        "classes": {"P0": {"max_wait_ms": 10_000}},
        "control": {"enabled": False},  # the test states the model itself
    }
    running = await make_daemon(extra)
    qos, admission = running.client, running.daemon.admission
    await admission.store.set_prefill(
        admission.pool("default"),
        PrefillLearned(model=(0.0, 10.0, 0.0), tolerance_ms=None, usual_tokens=0),
    )
    # The backlog drains from the first admission on, which comes after this.
    before_first = time.monotonic()
    first = await qos.acquire("P1", 80, max_wait_ms=0, timeout_s=10)  # 800 ms of prefill
    second = await qos.acquire("P1", 80, max_wait_ms=0, timeout_s=10)  # 800 ahead: within 1 s
    assert first.admitted and second.admitted
    third = await qos.acquire("P1", 80, max_wait_ms=0, timeout_s=10)  # 1.6 s ahead: full
    assert not third.admitted and third.reason is Reason.RATE_LIMITED
    # A waiter is admitted once the backlog has drained below the bound: 1.6 s of it,
    # less 1 s, after the first admission; so, whatever the calls took, no sooner
    # than 0.6 s after this test asked for the first.
    waiter = await qos.acquire("P0", 10, max_wait_ms=10_000)
    assert waiter.admitted
    assert time.monotonic() - before_first >= 0.6


async def test_the_prefill_share_bounds_the_lower_classes_prompts(
    make_daemon: DaemonFactory,
) -> None:
    """With a prefill share of 0.5, the backlog clock counts each prefill twice its
    time: below the top class, prompts are admitted while the clock is within the
    bound (10 s here), so they keep the servers prefilling at most half the time. The
    top class is bounded by the real prefill backlog (half the share clock's, here).
    The backlog drains as time passes: every step below keeps a second or more from
    its answer's turning, so a machine that takes its time between calls (a busy CI
    machine took over 150 ms with a 1 s bound) cannot change one."""
    pool = {"max_in_flight": 100, "max_prefill_backlog_ms": 10_000, "max_prefill_share": 0.5}
    running = await make_daemon({"pools": {"default": pool}, "control": {"enabled": False}})
    qos, admission = running.client, running.daemon.admission
    await admission.store.set_prefill(
        admission.pool("default"),
        PrefillLearned(model=(0.0, 10.0, 0.0), tolerance_ms=None, usual_tokens=0),
    )
    assert (await qos.acquire("P1", 450, max_wait_ms=0)).admitted  # alone: 9 s ahead
    assert (await qos.acquire("P1", 100, max_wait_ms=0)).admitted  # within 10 s: 11 s
    held = await qos.acquire("P1", 1, max_wait_ms=0)
    assert not held.admitted and held.reason is Reason.RATE_LIMITED
    # 11 s on the share clock is 5.5 s of prefill ahead: P0 goes, until 10 s of it.
    assert (await qos.acquire("P0", 400, max_wait_ms=0)).admitted  # 9.5 s
    assert (await qos.acquire("P0", 200, max_wait_ms=0)).admitted  # 11.5 s
    full = await qos.acquire("P0", 1, max_wait_ms=0)
    assert not full.admitted and full.reason is Reason.RATE_LIMITED


async def test_the_top_class_waits_for_the_real_prefill_not_the_share_clock(
    make_daemon: DaemonFactory,
) -> None:
    """A server that prefills first runs a prompt in its own time, not at the share's
    pace: the top class waits for the real backlog to be within the bound. Here a
    P1 prompt of 2 s of prefill (4 s on the share clock) was admitted alone; with a
    0.5 s bound P0 goes after about 1.5 s, within its 2.5 s max wait (by the share
    clock it would have waited 3 s and timed out), while a lower-class waiter still
    waits for the share clock."""
    pool = {"max_in_flight": 100, "max_prefill_backlog_ms": 500, "max_prefill_share": 0.5}
    running = await make_daemon(
        {
            "pools": {"default": pool},
            "classes": {"P0": {"max_wait_ms": 2_500}},
            "control": {"enabled": False},
        }
    )
    qos, admission = running.client, running.daemon.admission
    await admission.store.set_prefill(
        admission.pool("default"),
        PrefillLearned(model=(0.0, 20.0, 0.0), tolerance_ms=None, usual_tokens=0),
    )
    assert (await qos.acquire("P1", 100, max_wait_ms=0)).admitted  # alone: 2 s of prefill
    lower = asyncio.create_task(qos.acquire("P2", 1, max_wait_ms=10_000))
    await _until_waiting(qos, "P2", 1)
    top = await qos.acquire("P0", 1, max_wait_ms=2_500)
    assert top.admitted and top.reason is Reason.NONE
    assert not lower.done()  # the share clock still leads by more than the bound
    assert (await lower).admitted


async def test_no_work_conservation_before_the_backlog_can_be_predicted(
    make_daemon: DaemonFactory,
) -> None:
    """On servers that do not chunk prefill (a backlog bound from P0's objective),
    room is known only once the prefill model is: until then a class goes over its
    share no more than the buckets' rates allow."""
    extra = {
        **GATED,
        "classes": {"P0": {"slo": {"ttft_ms": 500}}},
        "control": {"enabled": False},  # the test states the model itself
    }
    running = await make_daemon(extra)
    qos, admission = running.client, running.daemon.admission
    assert (await qos.acquire("P2", 500, max_wait_ms=0)).admitted  # P2's whole burst
    assert not (await qos.acquire("P2", 400, max_wait_ms=0)).admitted  # no model yet
    await admission.store.set_prefill(
        admission.pool("default"),
        PrefillLearned(model=(0.0, 0.001, 0.0), tolerance_ms=None, usual_tokens=0),
    )
    assert (await qos.acquire("P2", 400, max_wait_ms=0)).admitted  # room is known now
