"""qosd.budget, directly: the arithmetic every store follows (the embedded store calls
it; _pool.lua restates it, held equal by tests/test_differential.py). No store, no
clock, no sleeps: part of ``make test-fast``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosd import budget
from qosd.config import Config
from qosd.policy import ClassPolicy, PoolPolicy, class_in, effective_pool, resolve_pools
from tests.conftest import BASE_CONFIG, merge

pytestmark = pytest.mark.fast

SECOND_US = 1_000_000


def pool_of(extra: dict[str, Any] | None = None) -> PoolPolicy:
    """BASE_CONFIG's pool: 10,000 tokens/s; P0 6,000 (burst 3,000), P1 3,000 (burst
    1,500), P2 1,000 (burst 500); no borrowing unless ``extra`` says so."""
    return resolve_pools(Config.model_validate(merge(BASE_CONFIG, extra or {})))["default"]


def cls(pool: PoolPolicy, name: str) -> ClassPolicy:
    return class_in(pool, name)


BORROWING = {"classes": {name: {"can_borrow": True} for name in ("P0", "P1", "P2")}}


# -- allocation: the class rates at a pool rate -------------------------------------------


def test_at_the_configured_capacity_the_policy_is_the_configured_one() -> None:
    pool = pool_of()
    assert effective_pool(pool, pool.capacity) is pool
    assert [c.rate for c in pool.classes] == [6_000, 3_000, 1_000]
    assert [c.burst for c in pool.classes] == [3_000, 1_500, 500]


def test_a_cut_takes_from_the_lowest_class_first_down_to_the_floors() -> None:
    pool = pool_of({"classes": {"P1": {"min_share": 0.1}, "P2": {"min_share": 0.05}}})
    cut = effective_pool(pool, 8_000)  # 2,000 less: P2 gives 500, then P1 1,500
    assert [c.rate for c in cut.classes] == pytest.approx([6_000, 1_500, 500])
    deep = effective_pool(pool, 3_000)  # floors first: P1 1,000, P2 500
    assert [c.rate for c in deep.classes] == pytest.approx([1_500, 1_000, 500])
    assert [c.burst for c in deep.classes] == pytest.approx([750, 500, 250])  # burst_s 0.5


def test_growth_above_the_shares_goes_to_the_shared_tokens() -> None:
    pool = pool_of()
    grown = effective_pool(pool, 15_000)
    assert [c.rate for c in grown.classes] == [6_000, 3_000, 1_000]  # shares unchanged
    assert grown.free_rate == pytest.approx(5_000)
    assert grown.shared_burst == pytest.approx(pool.burst_s * 15_000)


def test_a_gated_pools_bound_follows_cuts_but_never_grows_past_the_servers() -> None:
    pool = pool_of({"pools": {"default": {"max_in_flight": 100}}})
    assert effective_pool(pool, 5_000).max_in_flight == pytest.approx(50)
    assert effective_pool(pool, 20_000).max_in_flight == pytest.approx(100)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(capacity=st.floats(1.0, 100_000.0))
def test_the_allocation_never_hands_out_more_than_the_pool_rate(capacity: float) -> None:
    pool = pool_of({"classes": {"P1": {"min_share": 0.1}}})
    effective = effective_pool(pool, capacity)
    floors = sum(c.floor_rate for c in pool.classes)
    assigned = sum(c.rate for c in effective.classes) + effective.free_rate
    assert assigned == pytest.approx(max(capacity, floors))
    assert all(c.rate >= c.floor_rate - 1e-9 for c in effective.classes)


# -- refill, take, settle ------------------------------------------------------------------


def test_refill_fills_each_class_to_its_burst_and_overflows_to_shared() -> None:
    pool = pool_of()
    state = budget.fresh_state(pool, 0)
    state.tokens = {"P0": 0.0, "P1": 1_400.0, "P2": 0.0}
    state.shared = 0.0
    budget.refill(state, pool, SECOND_US // 10)  # 0.1 s
    assert state.tokens == pytest.approx({"P0": 600.0, "P1": 1_500.0, "P2": 100.0})
    assert state.shared == pytest.approx(200.0)  # P1's 300 less the 100 it had room for


def test_a_clock_that_steps_back_refills_nothing() -> None:
    pool = pool_of()
    state = budget.fresh_state(pool, 10 * SECOND_US)
    state.tokens["P0"] = 0.0
    budget.refill(state, pool, 9 * SECOND_US)
    assert state.tokens["P0"] == 0.0 and state.updated_us == 10 * SECOND_US


def test_a_lost_state_starts_empty_a_new_one_full() -> None:
    pool = pool_of()
    new, lost = budget.fresh_state(pool, 0), budget.fresh_state(pool, 0, lost=True)
    assert new.tokens == {"P0": 3_000, "P1": 1_500, "P2": 500} and new.shared > 0
    assert lost.tokens == dict.fromkeys(("P0", "P1", "P2"), 0.0) and lost.shared == 0.0


def test_own_tokens_first_then_shared_then_debt_from_a_full_bucket() -> None:
    pool = pool_of(BORROWING)
    p1 = cls(pool, "P1")
    state = budget.fresh_state(pool, 0)
    state.shared = 1_000.0
    assert budget.how_to_take(state, p1, 1_500, True) == budget.OWN
    state.tokens["P1"] = 100.0
    assert budget.how_to_take(state, p1, 800, True) == budget.BORROW
    assert budget.how_to_take(state, p1, 800, False) == 0  # shared closed by a waiter
    budget.take(state, p1, 800, budget.BORROW)
    assert state.tokens["P1"] == 0.0 and state.shared == pytest.approx(300.0)
    # A cost above the burst: from a full bucket only, into debt.
    state.tokens["P1"], state.shared = 1_500.0, 0.0
    assert budget.how_to_take(state, p1, 2_000, True) == budget.OWN
    budget.take(state, p1, 2_000, budget.OWN)
    assert state.tokens["P1"] == -500.0
    assert budget.how_to_take(state, p1, 10, True) == 0


def test_a_class_that_may_not_borrow_never_touches_shared() -> None:
    pool = pool_of()
    state = budget.fresh_state(pool, 0)
    state.tokens["P2"] = 10.0
    assert budget.how_to_take(state, cls(pool, "P2"), 20, True) == 0


def test_settle_refunds_to_the_burst_and_overflows_to_shared() -> None:
    pool = pool_of()
    p1 = cls(pool, "P1")
    state = budget.fresh_state(pool, 0)
    state.tokens["P1"], state.shared = 1_400.0, 0.0
    budget.settle(state, pool, p1, -300.0)  # used 300 less than charged
    assert state.tokens["P1"] == 1_500.0 and state.shared == pytest.approx(200.0)
    budget.settle(state, pool, p1, 2_000.0)  # used more: charged after the fact
    assert state.tokens["P1"] == -500.0


def test_retry_after_is_when_the_class_refills_enough() -> None:
    pool = pool_of()
    p1 = cls(pool, "P1")
    state = budget.fresh_state(pool, 0)
    state.tokens["P1"] = 0.0
    assert budget.retry_after_ms(state, pool, p1, 300) == 100  # 300 tokens at 3,000/s
    assert budget.retry_after_ms(state, pool, p1, 9_999) == 500  # capped by the burst


def test_aging_moves_a_waiter_up_one_rank_per_aging_interval() -> None:
    pool = pool_of({"classes": {"P2": {"aging_ms": 1_000}}})
    p2 = cls(pool, "P2")
    assert budget.effective_rank(p2, 0) == p2.rank
    assert budget.effective_rank(p2, SECOND_US) == p2.rank - 1
    assert budget.effective_rank(p2, 100 * SECOND_US) == 0


# -- leases in flight ----------------------------------------------------------------------


def test_leases_in_flight_end_by_release_or_by_their_expiry_second() -> None:
    flight = budget.InFlight()
    budget.lease_started(flight, "P1", 100.0, 5 * SECOND_US + 1)
    budget.lease_started(flight, "P1", 50.0, 7 * SECOND_US)
    assert (flight.count["P1"], flight.tokens["P1"]) == (2, 150.0)
    budget.lease_ended(flight, "P1", 50.0, 7 * SECOND_US, now_us=6 * SECOND_US)  # released
    assert (flight.count["P1"], flight.tokens["P1"]) == (1, 100.0)
    budget.end_expired(flight, now_us=5 * SECOND_US + 2)  # its second has not passed
    assert flight.count["P1"] == 1
    budget.end_expired(flight, now_us=6 * SECOND_US)
    assert flight.count["P1"] == 0 and flight.tokens["P1"] == 0.0
    # A release after the sweep ended it changes nothing.
    budget.lease_ended(flight, "P1", 100.0, 5 * SECOND_US + 1, now_us=8 * SECOND_US)
    assert flight.count["P1"] == 0


# -- tenants -------------------------------------------------------------------------------


def test_a_tenant_bucket_refills_to_its_burst_and_allows_up_to_it() -> None:
    bucket = budget.tenant_refilled(None, 0, rate=100.0, burst=50.0)
    assert bucket.tokens == 50.0
    bucket.tokens = 0.0
    refilled = budget.tenant_refilled(bucket, SECOND_US // 4, rate=100.0, burst=50.0)
    assert refilled.tokens == pytest.approx(25.0)
    assert budget.tenant_allows(refilled, 25, 50) and not budget.tenant_allows(refilled, 26, 50)
    assert budget.tenant_allows(budget.TenantBucket(50.0, 0), 500, 50)  # a cost above the burst
    assert budget.tenant_wait_ms(refilled, 35, 100.0, 50.0) == 100
