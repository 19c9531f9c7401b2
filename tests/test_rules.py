"""The budget rules, as the Lua scripts state them, on the embedded store with a clock
the test moves: allocation at the admitted rate, refill, borrowing, debt, settlement,
retry-after, aging, leases in flight and their sweep, tenant buckets, and the expiry
of every key a request leaves. The scripts are the one copy of the rules (the Redis
store runs them too); nothing here waits on the wall clock: part of ``make test-fast``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from qosd.config import Config
from qosd.model import LeaseSpec, Outcome, UsageReport, Waiter, new_lease_token
from qosd.policy import PoolPolicy, class_in, resolve_pools
from qosd.store.embedded import EmbeddedStore
from tests.clock import Clock
from tests.conftest import BASE_CONFIG, merge

pytestmark = pytest.mark.fast

DAEMON = "daemon-a"
BORROWING = {"classes": {name: {"can_borrow": True} for name in ("P0", "P1", "P2")}}


def setup(
    extra: dict[str, Any] | None = None, **store: Any
) -> tuple[EmbeddedStore, Clock, PoolPolicy]:
    """BASE_CONFIG's pool: 10,000 tokens/s; P0 6,000 (burst 3,000), P1 3,000 (burst
    1,500), P2 1,000 (burst 500); no borrowing unless ``extra`` says so."""
    clock = Clock()
    config = Config.model_validate(merge(BASE_CONFIG, extra or {}))
    settings = {"tombstone_ms": 60_000, "stale_after_ms": 500, "daemon_id": DAEMON, **store}
    return EmbeddedStore(clock=clock, **settings), clock, resolve_pools(config)["default"]


def lease(qos_class: str, cost: int, ttl_ms: int = 60_000, **kw: Any) -> LeaseSpec:
    """A lease of ``cost`` prompt tokens: what the scripts price it at, unless ``kw``
    gives it output tokens (the pool's output weight is 0) or another weight."""
    fields = {"request_id": "", "tenant": "", "output_tokens": 0, "weight": 1.0, **kw}
    return LeaseSpec(
        f"default:{qos_class}:{new_lease_token()}",
        fields["request_id"],
        fields["tenant"],
        cost,
        fields["output_tokens"],
        fields["weight"],
        ttl_ms,
    )


async def take(
    store: EmbeddedStore, pool: PoolPolicy, name: str, cost: int, wait_ms: int = 0, **kw: Any
) -> Any:
    spec = lease(name, cost, **kw)
    decision = await store.acquire(pool, class_in(pool, name), spec, wait_ms)
    return decision, spec


async def tokens(store: EmbeddedStore, pool: PoolPolicy) -> dict[str, float]:
    status = await store.status(pool)
    return {name: c.tokens for name, c in status.classes.items()} | {"shared": status.shared_tokens}


async def set_rate(store: EmbeddedStore, pool: PoolPolicy, capacity: float) -> None:
    record = await store.control(pool)
    update = dataclasses.replace(record, capacity=capacity, reason="test", changed_by="test")
    assert await store.adjust(pool, update, cooldown_ms=0, force=True)


# -- allocation: the class rates at the admitted rate --------------------------------------


async def test_a_cut_takes_from_the_lowest_class_first_down_to_the_floors() -> None:
    store, _, pool = setup({"classes": {"P1": {"min_share": 0.1}, "P2": {"min_share": 0.05}}})
    rates = {name: c.rate for name, c in (await store.status(pool)).classes.items()}
    assert rates == {"P0": 6_000, "P1": 3_000, "P2": 1_000}
    await set_rate(store, pool, 8_000)  # 2,000 less: P2 gives 500, then P1 1,500
    cut = (await store.status(pool)).classes
    assert [cut[n].rate for n in ("P0", "P1", "P2")] == pytest.approx([6_000, 1_500, 500])
    await set_rate(store, pool, 3_000)  # floors first: P1 1,000, P2 500
    deep = (await store.status(pool)).classes
    assert [deep[n].rate for n in ("P0", "P1", "P2")] == pytest.approx([1_500, 1_000, 500])
    assert [deep[n].burst for n in ("P0", "P1", "P2")] == pytest.approx([750, 500, 250])


async def test_growth_above_the_shares_goes_to_the_shared_tokens() -> None:
    store, clock, pool = setup()
    await set_rate(store, pool, 15_000)
    grown = await store.status(pool)
    assert [grown.classes[n].rate for n in ("P0", "P1", "P2")] == [6_000, 3_000, 1_000]
    # The shared tokens hold burst_s of the rate: 7,500 now, refilled by the free 5,000/s.
    assert (await take(store, pool, "P0", 3_000))[0].admitted  # P0's own burst, spent
    clock.advance(1_000)
    assert (await store.status(pool)).shared_tokens == pytest.approx(7_500)


# -- refill, take, settle, retry-after -----------------------------------------------------


async def test_refill_fills_each_class_to_its_burst_and_overflows_to_shared() -> None:
    store, clock, pool = setup(BORROWING)
    for name, burst in (("P0", 3_000), ("P1", 1_500), ("P2", 500)):
        assert (await take(store, pool, name, burst))[0].admitted
    for _ in range(2):  # the shared 5,000 too
        assert (await take(store, pool, "P0", 2_500))[0].admitted
    assert await tokens(store, pool) == {"P0": 0, "P1": 0, "P2": 0, "shared": 0}
    clock.advance(100)
    assert await tokens(store, pool) == pytest.approx(
        {"P0": 600, "P1": 300, "P2": 100, "shared": 0}
    )
    clock.advance(500)  # each class past its burst: what is over it overflows to shared
    assert await tokens(store, pool) == pytest.approx(
        {"P0": 3_000, "P1": 1_500, "P2": 500, "shared": 600 + 300 + 100}
    )


async def test_a_clock_that_steps_back_refills_nothing() -> None:
    store, clock, pool = setup()
    assert (await take(store, pool, "P0", 3_000))[0].admitted
    clock.advance(-10_000)
    assert (await tokens(store, pool))["P0"] == 0
    clock.advance(10_100)  # back where it was, and 100 ms on
    assert (await tokens(store, pool))["P0"] == pytest.approx(600)


async def test_own_tokens_first_then_shared_then_debt_from_a_full_bucket() -> None:
    store, _, pool = setup(merge(BORROWING, {"classes": {"P1": {"max_cost_tokens": 4_000}}}))
    assert (await take(store, pool, "P1", 1_400))[0].admitted  # own: 100 left
    decision, _ = await take(store, pool, "P1", 800)  # 100 own, 700 shared
    assert decision.admitted
    assert await tokens(store, pool) == pytest.approx(
        {"P0": 3_000, "P1": 0, "P2": 500, "shared": 4_300}
    )
    store, _, pool = setup({"classes": {"P1": {"max_cost_tokens": 4_000}}})
    # A cost above the burst goes from a full bucket only, into debt ...
    assert (await take(store, pool, "P1", 2_000))[0].admitted
    assert (await tokens(store, pool))["P1"] == -500
    # ... and the class waits for it to be paid back.
    decision, _ = await take(store, pool, "P1", 10)
    assert not decision.admitted and decision.retry_after_ms == 170  # 510 at 3,000/s


async def test_a_class_that_may_not_borrow_never_touches_shared() -> None:
    store, _, pool = setup()
    assert (await take(store, pool, "P2", 490))[0].admitted
    decision, _ = await take(store, pool, "P2", 20)
    assert not decision.admitted
    assert (await store.status(pool)).shared_tokens == pytest.approx(5_000)


async def test_settle_refunds_to_the_burst_and_overflows_to_shared() -> None:
    store, clock, pool = setup(BORROWING)
    p1 = class_in(pool, "P1")
    for cost in (3_000, 2_000):  # P0's own, then 2,000 of the 5,000 shared
        assert (await take(store, pool, "P0", cost))[0].admitted
    decision, charged = await take(store, pool, "P1", 1_000)
    assert decision.admitted and (await tokens(store, pool))["P1"] == 500
    usage = UsageReport(200, 0, Outcome.OK)  # used 200 of the 1,000 charged
    assert (await store.release(pool, p1, charged.lease_id, usage)).adjustment == -800
    assert (await tokens(store, pool))["P1"] == pytest.approx(1_300)
    _, charged = await take(store, pool, "P1", 1_000)  # 300 left
    clock.advance(300)  # P1 refills 900 (1,200); P2's 300 overflow into shared (3,300)
    usage = UsageReport(0, 0, Outcome.CANCELLED)  # all 1,000 back: 2,200
    await store.release(pool, p1, charged.lease_id, usage)
    after = await tokens(store, pool)
    assert after == pytest.approx({"P0": 1_800, "P1": 1_500, "P2": 500, "shared": 4_000})
    _, charged = await take(store, pool, "P1", 100)
    usage = UsageReport(900, 0, Outcome.OK)  # used 800 more: charged after the fact
    assert (await store.release(pool, p1, charged.lease_id, usage)).adjustment == 800
    assert (await tokens(store, pool))["P1"] == pytest.approx(600)


async def test_retry_after_is_when_the_class_refills_enough() -> None:
    store, _, pool = setup({"classes": {"P1": {"max_cost_tokens": 20_000}}})
    assert (await take(store, pool, "P1", 1_500))[0].admitted
    decision, _ = await take(store, pool, "P1", 300)
    assert not decision.admitted and decision.retry_after_ms == 100  # 300 at 3,000/s
    decision, _ = await take(store, pool, "P1", 9_999)
    assert decision.retry_after_ms == 500  # a full bucket: capped by the burst


# -- the waiting room: aging ---------------------------------------------------------------


@pytest.mark.parametrize("aging_ms", [0, 10])
async def test_aging_moves_a_waiter_up_one_rank_per_aging_interval(aging_ms: int) -> None:
    """Each class is assured 500 tokens/s and 8,500 refill the shared tokens. A P2
    request and, 20 ms later, a P1 one wait for shared tokens, enough for one: without
    aging P1 goes first; with P2 aging a rank every 10 ms, P2 (now rank 0) does."""
    shares = {
        name: {"share": 0.05, "can_borrow": True, "max_cost_tokens": 1_000, "max_wait_ms": 30_000}
        for name in ("P0", "P1", "P2")
    }
    store, clock, pool = setup(
        {"classes": {**shares, "P2": {**shares["P2"], "aging_ms": aging_ms}}}
    )
    for name in ("P0", "P1", "P2"):
        assert (await take(store, pool, name, 250))[0].admitted
    for _ in range(5):
        assert (await take(store, pool, "P0", 1_000))[0].admitted  # the shared 5,000
    low, low_spec = await take(store, pool, "P2", 600, wait_ms=30_000)
    clock.advance(20)
    high, high_spec = await take(store, pool, "P1", 600, wait_ms=30_000)
    assert low.queued and high.queued
    clock.advance(60)  # own 40 each, shared 680: one of them is covered
    states = await store.pump(pool, [Waiter("P2", 600.0, low_spec), Waiter("P1", 600.0, high_spec)])
    expected = ["WAITING", "ADMITTED"] if aging_ms == 0 else ["ADMITTED", "WAITING"]
    assert [s.state.name for s in states] == expected


# -- leases in flight and their sweep ------------------------------------------------------


async def test_leases_in_flight_end_by_release_or_by_their_expiry_second() -> None:
    store, clock, pool = setup()
    await take(store, pool, "P1", 100, ttl_ms=2_000)
    _, long = await take(store, pool, "P1", 50, ttl_ms=60_000)
    flight = (await store.status(pool)).classes["P1"]
    assert (flight.in_flight, flight.in_flight_tokens) == (2, 150)
    await store.release(pool, class_in(pool, "P1"), long.lease_id, UsageReport(50, 0, Outcome.OK))
    assert (await store.status(pool)).classes["P1"].in_flight == 1
    clock.advance(2_000)  # its expiry second has not passed yet
    assert (await store.status(pool)).classes["P1"].in_flight == 1
    clock.advance(1_000)
    flight = (await store.status(pool)).classes["P1"]
    assert (flight.in_flight, flight.in_flight_tokens) == (0, 0)


async def test_the_sweep_catches_up_64_seconds_a_call_after_a_long_idle() -> None:
    store, clock, pool = setup()
    for ttl_s in range(1, 201):  # a lease expiring in each of 200 seconds
        await take(store, pool, "P2", 1, ttl_ms=ttl_s * 1_000)
    assert (await store.status(pool)).classes["P2"].in_flight == 200
    clock.advance(151_000)  # idle past the expiry seconds of 150 of them
    counts = []
    for _ in range(3):
        # Each pool script sweeps at most 64 seconds of expiries, the status too.
        await take(store, pool, "P0", 1)
        counts.append((await store.status(pool)).classes["P2"].in_flight)
    assert counts == [200 - 128, 50, 50]  # not all at once


# -- tenants -------------------------------------------------------------------------------


async def test_a_tenant_bucket_refills_to_its_burst_and_allows_up_to_it() -> None:
    store, clock, pool = setup({"classes": {"P1": {"tenant_max_share": 0.01}}})  # 100/s
    p1 = class_in(pool, "P1")
    assert (p1.tenant_rate, p1.tenant_burst) == (100, 50)
    assert (await take(store, pool, "P1", 50, tenant="acme"))[0].admitted
    decision, _ = await take(store, pool, "P1", 35, tenant="acme")
    assert not decision.admitted and decision.retry_after_ms == 350
    assert (await take(store, pool, "P1", 35, tenant="other"))[0].admitted
    clock.advance(250)  # 25 back
    assert (await take(store, pool, "P1", 25, tenant="acme"))[0].admitted
    assert not (await take(store, pool, "P1", 1, tenant="acme"))[0].admitted


# -- what a request leaves behind expires --------------------------------------------------


async def test_request_ids_leases_and_tenants_leave_no_keys_once_expired() -> None:
    store, clock, pool = setup({"classes": {"P1": {"tenant_max_share": 0.01}}}, tombstone_ms=1_000)
    before = set(store.transport.host.keys())
    for n in range(200):
        await take(store, pool, "P1", 1, ttl_ms=1_000, request_id=f"r{n}", tenant=f"t{n}")
    grown = set(store.transport.host.keys()) - before
    assert any(":req:" in k for k in grown) and any(":tenant:" in k for k in grown)
    assert any(":leases:" in k for k in grown)
    clock.advance(10_000)  # past the lease TTL, its tombstone and the 5-s margin
    left = set(store.transport.host.keys()) - before
    assert not [k for k in left if ":req:" in k or ":tenant:" in k or ":leases:" in k]
