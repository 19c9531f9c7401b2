"""The waiting room's fleet-wide order, at the store, on the embedded store with a
clock the test moves: FIFO within a class across daemons, priority and aging across
classes, and a silent daemon's entries dropped after ``stale_after_ms``. Part of
``make test-fast``: no sockets, no sleeps, the same answers every run."""

from __future__ import annotations

from typing import Any

import pytest

from qosd.config import Config
from qosd.model import LeaseSpec, Waiter, new_lease_token
from qosd.policy import ClassPolicy, PoolPolicy, resolve_pools
from qosd.store.embedded import EmbeddedStore
from tests.clock import Clock
from tests.conftest import BASE_CONFIG, merge

pytestmark = pytest.mark.fast

A, B = "daemon-a", "daemon-b"


def setup(
    extra: dict[str, Any] | None = None,
) -> tuple[dict[str, EmbeddedStore], Clock, PoolPolicy]:
    """Daemons A and B, each with its own store on one keyspace (as two daemons share
    one Redis), the clock both read, and the pool."""
    clock = Clock()
    config = Config.model_validate(merge(BASE_CONFIG, extra or {}))
    a = EmbeddedStore(tombstone_ms=60_000, stale_after_ms=500, clock=clock, daemon_id=A)
    b = EmbeddedStore(tombstone_ms=60_000, stale_after_ms=500, daemon_id=B, shared_with=a)
    return {A: a, B: b}, clock, resolve_pools(config)["default"]


def of(pool: PoolPolicy, name: str) -> ClassPolicy:
    return next(cls for cls in pool.classes if cls.name == name)


def lease(qos_class: str, cost: int) -> LeaseSpec:
    return LeaseSpec(f"default:{qos_class}:{new_lease_token()}", "", "", cost, 0, 1.0, 60_000)


async def queue(store: EmbeddedStore, pool: PoolPolicy, qos_class: str, cost: int) -> Waiter:
    """Queues a request of ``cost`` for the daemon whose store this is."""
    spec = lease(qos_class, cost)
    decision = await store.acquire(pool, of(pool, qos_class), spec, 30_000)
    assert decision.queued, decision
    return Waiter(qos_class, float(cost), spec)


async def states(store: EmbeddedStore, pool: PoolPolicy, *waiters: Waiter) -> list[str]:
    """Pumps as the daemon whose store this is, holding ``waiters``."""
    return [r.state.name for r in await store.pump(pool, list(waiters))]


async def test_within_a_class_the_first_to_queue_goes_first_whichever_daemon_asks() -> None:
    stores, clock, pool = setup()
    p1 = of(pool, "P1")
    assert (await stores[A].acquire(pool, p1, lease("P1", 1_500), 0)).admitted  # drained
    first = await queue(stores[A], pool, "P1", 600)
    second = await queue(stores[B], pool, "P1", 300)
    clock.advance(150)  # 450 tokens: enough for B's 300, not for A's 600 ahead of it
    assert await states(stores[B], pool, second) == ["WAITING"]  # held behind A's head
    clock.advance(50)  # 600
    assert await states(stores[B], pool, second) == ["WAITING"]  # A's, for A to take
    assert await states(stores[A], pool, first) == ["ADMITTED"]
    clock.advance(100)  # 300 more
    assert await states(stores[B], pool, second) == ["ADMITTED"]


async def test_a_higher_class_goes_before_an_earlier_lower_one_for_shared_tokens() -> None:
    """Each class is assured 500 tokens/s and the 8,500 left refill the shared tokens,
    which every class may borrow. A P2 request queues first, a P0 one later, both
    needing shared tokens: when there are enough for one, it is P0's, even when the
    daemon holding the P2 request asks first."""
    shares = {
        name: {"share": 0.05, "can_borrow": True, "max_cost_tokens": 1_000}
        for name in ("P0", "P1", "P2")
    }
    stores, clock, pool = setup({"classes": shares})
    p0, p2 = of(pool, "P0"), of(pool, "P2")
    assert [c.rate for c in pool.classes] == [500, 500, 500]
    assert pool.capacity - sum(c.rate for c in pool.classes) == 8_500  # free (allocation.lua)
    shared_burst = (await stores[A].status(pool)).shared_burst
    # Drain P0's and P2's own tokens (250 each), then the shared ones, borrowed by P0.
    for cls, cost in ((p0, 250), (p2, 250), *[(p0, 250)] * int(shared_burst // 250)):
        assert (await stores[A].acquire(pool, cls, lease(cls.name, cost), 0)).admitted
    assert (await stores[A].status(pool)).shared_tokens == 0
    low = await queue(stores[A], pool, "P2", 400)
    high = await queue(stores[B], pool, "P0", 400)
    clock.advance(50)  # own 25 each; shared 425 (free) + 25 (P1 overflows): P0 is covered
    assert await states(stores[A], pool, low) == ["WAITING"]  # asks first, but P0 goes first
    assert await states(stores[B], pool, high) == ["ADMITTED"]
    assert await states(stores[A], pool, low) == ["WAITING"]  # 25 own + 75 shared left
    clock.advance(40)  # own 45; shared 75 + 340 + 20
    assert await states(stores[A], pool, low) == ["ADMITTED"]


async def test_a_silent_daemons_entries_stop_holding_the_queue_after_stale_after() -> None:
    stores, clock, pool = setup()
    p1 = of(pool, "P1")
    assert (await stores[A].acquire(pool, p1, lease("P1", 1_500), 0)).admitted
    await queue(stores[A], pool, "P1", 1_200)  # A's head, then A goes silent (killed)
    mine = await queue(stores[B], pool, "P1", 100)
    clock.advance(100)  # 300 tokens: B's would fit, A's head holds it
    assert await states(stores[B], pool, mine) == ["WAITING"]
    clock.advance(300)  # A silent for 400 ms: still alive by the rule
    assert await states(stores[B], pool, mine) == ["WAITING"]
    clock.advance(150)  # 550 ms: A's entry is dropped, B's goes
    assert await states(stores[B], pool, mine) == ["ADMITTED"]
    assert (await stores[A].status(pool)).classes["P1"].waiting == 0


async def test_a_waiter_past_its_deadline_is_never_admitted() -> None:
    """A wait ends by its max wait: once a waiter's deadline has passed, no pump admits
    it, though the tokens are there and its entry stays until its daemon cancels it
    (or the store drops it ``stale_after_ms`` later); a new request is not held
    behind it."""
    stores, clock, pool = setup()
    p1 = of(pool, "P1")
    assert (await stores[A].acquire(pool, p1, lease("P1", 1_500), 0)).admitted  # drained
    spec = lease("P1", 200)
    assert (await stores[A].acquire(pool, p1, spec, 100)).queued  # may wait 100 ms
    late = Waiter("P1", 200.0, spec)
    clock.advance(150)  # 450 tokens refilled, but its 100 ms ended 50 ms ago
    assert await states(stores[A], pool, late) == ["WAITING"]
    assert (await stores[B].acquire(pool, p1, lease("P1", 200), 0)).admitted
    # A wait pumped within its deadline is admitted.
    on_time = lease("P1", 400)
    assert (await stores[A].acquire(pool, p1, on_time, 100)).queued  # 250 tokens left
    clock.advance(90)  # 520
    assert await states(stores[A], pool, Waiter("P1", 400.0, on_time)) == ["ADMITTED"]
