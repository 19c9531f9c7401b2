"""The top class's reserve in a GPU-gated pool follows its recent peak demand, on every
backend (qosd/store/lua/pool/budget.lua: has_room).

Classes below the top one leave free what the top class held at its recent peak (in
flight plus waiting) less what it holds now, up to half the bound; the peak decays by
``top_reserve_half_life_s``. The fixed ``top_reserve`` is 0 here, so every slot held
back is the dynamic reserve's.
"""

from __future__ import annotations

from typing import Any

from qosd_client import QosdClient
from tests.conftest import DaemonFactory
from tests.waiting import eventually

SLOTS = 10


def gated(half_life_s: float) -> dict[str, Any]:
    pool = {
        "max_in_flight": SLOTS,
        "top_reserve": 0,
        "top_reserve_half_life_s": half_life_s,
    }
    return {"pools": {"default": pool}, "control": {"enabled": False}}


async def admitted_now(qos: QosdClient, qos_class: str, count: int) -> list[str]:
    """Acquires ``count`` requests that may not wait; the lease ids of those admitted."""
    leases = []
    for _ in range(count):
        result = await qos.acquire(qos_class, 10, max_wait_ms=0)
        if result.admitted:
            leases.append(result.lease_id)
    return leases


async def test_lower_classes_leave_room_for_the_top_class_s_recent_peak(
    make_daemon: DaemonFactory,
) -> None:
    """P0 peaked at 4 and holds 2: P1 leaves 2 slots free (8 of 10 in flight); P0 then
    finds them at once. An hour's half-life: the peak cannot fade during the test."""
    running = await make_daemon(gated(half_life_s=3_600))
    qos = running.client
    top = await admitted_now(qos, "P0", 4)
    assert len(top) == 4
    for lease_id in top[:2]:
        await qos.release(lease_id)
    lower = await admitted_now(qos, "P1", SLOTS)
    assert len(lower) == SLOTS - 4  # 2 held by P0, 2 kept free for it
    assert len(await admitted_now(qos, "P0", 3)) == 2  # the reserve, then the bound


async def test_the_peak_reserve_is_at_most_half_the_bound(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(gated(half_life_s=3_600))
    qos = running.client
    top = await admitted_now(qos, "P0", 8)
    assert len(top) == 8
    for lease_id in top:
        await qos.release(lease_id)
    assert len(await admitted_now(qos, "P1", SLOTS)) == SLOTS // 2


async def test_without_a_half_life_only_the_fixed_reserve_holds(
    make_daemon: DaemonFactory,
) -> None:
    running = await make_daemon(gated(half_life_s=0))
    qos = running.client
    top = await admitted_now(qos, "P0", 4)
    for lease_id in top:
        await qos.release(lease_id)
    assert len(await admitted_now(qos, "P1", SLOTS)) == SLOTS


async def test_the_reserve_fades_with_the_peak(make_daemon: DaemonFactory) -> None:
    """A 0.2 s half-life: a peak of 4 keeps 4 slots free at first, and none once it has
    faded below half a request (0.6 s): P1 then takes the last slot."""
    running = await make_daemon(gated(half_life_s=0.2))
    qos = running.client
    top = await admitted_now(qos, "P0", 4)
    for lease_id in top:
        await qos.release(lease_id)
    held = await admitted_now(qos, "P1", SLOTS)
    assert SLOTS - 4 <= len(held) < SLOTS  # however slowly the test runs, not all

    async def one_more() -> int:
        held.extend(await admitted_now(qos, "P1", 1))
        return len(held)

    assert await eventually(one_more, lambda n: n == SLOTS) == SLOTS
