"""A pump's grants reach their callers in the order the store made them.

The store predicts each grant's prefill behind the grants it made before it in the
same pump. On servers that prefill oldest first, a short prompt whose answer went out
after a long one's reaches them second and waits out the long one's prefill, however
its first token was predicted. So the pump numbers its grants, and the waiting room
answers them in that order, not in the order its waiters joined. Run on the embedded
store, a standalone Redis and a 3-node cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from qosd.model import LeaseSpec, Outcome, PumpResult, UsageReport, Waiter, WaiterState
from qosd.policy import ClassPolicy, PoolPolicy
from qosd.store.base import BucketStore
from qosd.waiting import WaitingRoom
from tests.conftest import DaemonFactory, RunningDaemon
from tests.test_waiting_races import lease, no_store

# Two requests in flight at most, and waits long enough that only the slots decide.
TWO_SLOTS: dict[str, Any] = {
    "pools": {"default": {"max_in_flight": 2, "top_reserve": 0}},
    "classes": {name: {"max_wait_ms": 30_000} for name in ("P0", "P1", "P2")},
}


class GatedPumps:
    """The daemon's store, whose pumps wait until the test opens them: so that one
    pump sees every waiter the test queued and every slot it freed."""

    def __init__(self, inner: BucketStore) -> None:
        self.inner = inner
        self.open = asyncio.Event()
        self.asked = asyncio.Event()  # a pump is waiting to run
        self.waiters: list[str] = []  # the classes of the waiters the first pump holds

    async def pump(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> list[PumpResult]:
        if not self.asked.is_set():
            self.waiters = [waiter.qos_class for waiter in waiters]
            self.asked.set()
        await self.open.wait()
        return await self.inner.pump(pool, waiters)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _full_pool_with_two_waiters(
    running: RunningDaemon,
) -> tuple[BucketStore, PoolPolicy, dict[str, ClassPolicy], list[LeaseSpec]]:
    """Both slots taken by P1 (P0's would leave room for P0's next burst), then a P2
    waiter queued before a P1 waiter; both slots freed. Returns the store, the pool,
    its classes and the two waiters' leases."""
    admission = running.daemon.admission
    store, pool = admission.store, admission.pool("default")
    classes = {cls.name: cls for cls in pool.classes}
    held = [await store.acquire(pool, classes["P1"], lease("P1", 100), 0) for _ in range(2)]
    assert all(answer.admitted for answer in held)
    waiting = [lease("P2", 100), lease("P1", 100)]
    for spec in waiting:
        queued = await store.acquire(pool, classes[spec.lease_id.split(":")[1]], spec, 30_000)
        assert queued.queued
    for answer in held:
        usage = UsageReport(100, 0, Outcome.OK)
        await store.release(pool, classes["P1"], answer.lease_id, usage)
    return store, pool, classes, waiting


async def test_a_pump_numbers_its_grants_in_the_order_it_made_them(
    make_daemon: DaemonFactory,
) -> None:
    running = await make_daemon(TWO_SLOTS)
    store, pool, _, (p2, p1) = await _full_pool_with_two_waiters(running)
    results = await store.pump(pool, [Waiter("P2", 100, p2), Waiter("P1", 100, p1)])
    assert [result.state for result in results] == [WaiterState.ADMITTED] * 2
    # The P1 waiter goes first (it ranks before P2), though it joined second.
    assert [result.granted for result in results] == [2, 1]


async def test_the_room_answers_a_pumps_grants_in_their_order(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(TWO_SLOTS)
    store, pool, _, (p2, p1) = await _full_pool_with_two_waiters(running)
    gated = GatedPumps(store)
    room = WaitingRoom(gated, 0.005, no_store)
    answered: list[str] = []
    waits = []
    for name, spec in (("P2", p2), ("P1", p1)):  # the P2 waiter joins the room first
        wait = asyncio.create_task(room.wait(pool, Waiter(name, 100, spec), 30))
        wait.add_done_callback(lambda _, name=name: answered.append(name))  # type: ignore[misc]
        waits.append(wait)
    await asyncio.wait_for(gated.asked.wait(), 10)
    assert gated.waiters == ["P2", "P1"]  # one pump holds both, in the order they joined
    gated.open.set()
    assert all(answer.admitted for answer in await asyncio.gather(*waits))
    assert answered == ["P1", "P2"]
    await room.close()
