"""The embedded store runs the same Lua scripts as Redis, on LuaJIT with a keyspace
written in Lua (``qosd.store.lua_host``): this test holds that host to a real Redis,
so that the two runtimes and the two keyspaces can never drift apart unseen (number
formatting, table order, reply conversion, expiry). Hypothesis drives both stores
through the ``BucketStore`` interface with the same random sequences of acquires
(admitted at once or queued), releases, pumps, cancels, rate changes and pins, and
compares every answer and the pools' state after every step.

Time: the embedded store runs on a frozen clock; Redis's cannot be stopped, so the
pool refills so slowly that no example can see it: 1/8 token/s in all (1/4 at the
most a rate change allows), a fraction of a token in the seconds an example may take
on a loaded machine. Shares are powers of two, and bursts, costs and real counts
whole numbers of tokens that three halvings of the rate leave whole, so the embedded
store's balances stay whole: a decision could differ only where Redis's refill
crossed a whole token. Answers compare exactly, balances within one token.

Run on the embedded store alone (``make test-fast``) the same machine checks the
invariants: balances never above the burst, leases in flight matching those admitted
and not released, each queue holding exactly the waiters not yet answered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from qosd.config import Config
from qosd.model import (
    BucketDecision,
    LeaseSpec,
    Outcome,
    PoolStatus,
    Sample,
    ServerLoad,
    UsageReport,
    Waiter,
    WaiterState,
)
from qosd.policy import PoolPolicy, resolve_pools, tenant_digest
from qosd.store.base import BucketStore
from qosd.store.embedded import EmbeddedStore
from qosd.store.redis import RedisStore

T = TypeVar("T")
DAEMON = "differential"
FROZEN_US = 1_000_000_000_000
CLASSES = ("P0", "P1", "P2")
TENANTS = ("acme", "globex", "initech")  # P1 shares by tokens among them
MAX_COST = 300  # above the largest burst (224) too
# Costs mostly small, so that buckets last, sometimes up to and over a burst. The real
# count at release is a multiple of the cost: half the time less (a refund, which is
# when queued waiters get in at these rates), or an underestimate settled into debt.
COSTS = st.one_of(st.integers(1, 24), st.integers(1, MAX_COST))
USED_PER_COST = st.sampled_from([0, 0.5, 1, 1, 2, 3])
REPORT_WINDOW = 5
# An hour: at these rates a waiter needs minutes of refill, which no run lasts, so
# waiters get in through refunds, rate changes and room freed by releases.
MAX_WAIT_MS = 3_600_000


def pool_config(gated: bool) -> dict[str, Any]:
    # Buckets of 224, 112 and 56 tokens (3,584 s of each rate) and 48 shared tokens
    # (384 s of capacity): multiples of 8, as the rate may be halved three times.
    pool: dict[str, Any] = {"capacity_tokens_s": 1 / 8, "burst_s": 384}
    if gated:
        # The servers' own reports count too: more than 4 waiting there and only the
        # top class is let in (their reads never age out within a run).
        pool |= {"max_in_flight": 6, "top_reserve": 0.25, "max_server_waiting": 4,
                 "server_load_max_age_ms": 600_000}  # fmt: skip
    burst_s = 3_584
    return {
        "pools": {"default": pool},
        "classes": {
            "P0": {"priority": 0, "share": 0.5, "burst_s": burst_s, "max_wait_ms": MAX_WAIT_MS},
            # P1's tenants share it by tokens (VTC): its waiters go by their tenant's
            # counter, whose keys and refunds the two runtimes must also agree on.
            "P1": {"priority": 1, "share": 0.25, "burst_s": burst_s, "max_wait_ms": MAX_WAIT_MS,
                   "fairness": "vtc"},
            "P2": {"priority": 2, "share": 0.125, "burst_s": burst_s, "max_wait_ms": MAX_WAIT_MS,
                   "can_borrow": False},
        },
        # The rate may go from 1/8 to 4 times the configured one: three halvings.
        "control": {"min_capacity": 0.125, "max_capacity": 4.0},
        "waiting": {"stale_after_ms": 600_000},
        "lease": {"ttl_s": 600},
    }  # fmt: skip


class Stores:
    """The stores under test, and one event loop to run their calls on."""

    def __init__(self, redis: dict[str, Any] | None, gated: bool) -> None:
        self.loop = asyncio.new_event_loop()
        tree = pool_config(gated)
        if redis is not None:
            # A loaded machine (CI, coverage on) can hold one call past the default
            # 100 ms: an outage is not what this test compares. Nor is a connection's
            # setup or close, which redis-py bounds by the connect timeout (250 ms by
            # default: a busy machine's close of a cluster's connections took longer).
            tree["redis"] = {
                **redis,
                "key_prefix": f"d{uuid.uuid4().hex[:12]}",
                "timeout_ms": 10_000,
                "connect_timeout_ms": 10_000,
            }
        config = Config.model_validate(tree)
        self.pool: PoolPolicy = resolve_pools(config)["default"]
        self.classes = {cls.name: cls for cls in self.pool.classes}
        embedded = EmbeddedStore(tombstone_ms=600_000, stale_after_ms=600_000,
                                 clock=lambda: FROZEN_US, daemon_id=DAEMON)  # fmt: skip
        self.all: list[BucketStore] = [embedded]
        if redis is not None:
            self.all.append(
                RedisStore(
                    config.redis,
                    tombstone_ms=600_000,
                    stale_after_ms=600_000,
                    lease_ttl_ms=600_000,
                    daemon_id=DAEMON,
                )
            )
        for store in self.all:
            self.run(store.start())

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def each(self, call: Callable[[BucketStore], Coroutine[Any, Any, T]]) -> list[T]:
        """``call(store)`` on every store, in turn; their answers, embedded first."""
        return [self.run(call(store)) for store in self.all]

    def close(self) -> None:
        for store in self.all:
            self.run(store.close())
        self.loop.close()


def same_decision(answers: list[BucketDecision]) -> None:
    first = answers[0]
    for other in answers[1:]:
        assert (other.admitted, other.queued, other.reason, other.duplicate) == (
            first.admitted, first.queued, first.reason, first.duplicate,
        ), answers  # fmt: skip
        assert other.charged == pytest.approx(first.charged, abs=1e-6), answers
        assert other.remaining == pytest.approx(first.remaining, abs=1.0), answers


def same_status(statuses: list[PoolStatus]) -> None:
    first = statuses[0]
    for other in statuses[1:]:
        assert other.shared_tokens == pytest.approx(first.shared_tokens, abs=1.0)
        assert other.capacity == pytest.approx(first.capacity, rel=1e-9)
        for name, cls in first.classes.items():
            theirs = other.classes[name]
            assert theirs.tokens == pytest.approx(cls.tokens, abs=1.0), (name, statuses)
            assert (theirs.waiting, theirs.in_flight) == (cls.waiting, cls.in_flight), name
            assert theirs.in_flight_tokens == pytest.approx(cls.in_flight_tokens, abs=1e-6)
        assert other.server_waiting == first.server_waiting, statuses
        assert other.server_kv_usage == pytest.approx(first.server_kv_usage), statuses


class Budgets(RuleBasedStateMachine):
    """One pool on every store, driven alike."""

    redis: dict[str, Any] | None = None
    gated = False

    leases = Bundle("leases")
    waiters = Bundle("waiters")

    def __init__(self) -> None:
        super().__init__()
        self.stores = Stores(self.redis, self.gated)
        self.tokens = itertools.count(1)
        self.in_flight: dict[str, int] = dict.fromkeys(CLASSES, 0)  # admitted, not released
        self.queued: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.pending: list[Waiter] = []  # queued, in arrival order
        self.pumped_in = 0  # waiters a pump admitted

    def teardown(self) -> None:
        self.stores.close()

    def lease(self, qos_class: str, cost: int, request_id: str = "") -> LeaseSpec:
        n = next(self.tokens)
        token = f"{n:08x}{'0' * 24}"
        tenant = TENANTS[n % len(TENANTS)]
        if self.stores.classes[qos_class].fair is not None:
            token = f"{token}-{tenant_digest(tenant)}"
        return LeaseSpec(f"default:{qos_class}:{token}", request_id, tenant, cost, 0, 1.0, 600_000)

    @initialize()
    def start(self) -> None:
        self.check_state()

    @rule(
        target=leases,
        qos_class=st.sampled_from(CLASSES),
        cost=COSTS,
        request_id=st.sampled_from(["", "", "", "req-a", "req-b"]),
    )
    def acquire(self, qos_class: str, cost: int, request_id: str) -> Any:
        """Admitted at once or refused (no wait): the answer is the same everywhere."""
        spec = self.lease(qos_class, cost, request_id)
        cls = self.stores.classes[qos_class]
        answers = self.stores.each(lambda store: store.acquire(self.stores.pool, cls, spec, 0))
        same_decision(answers)
        first = answers[0]
        # A request id already recorded is a duplicate: not admitted, nothing charged.
        assert not (first.duplicate and first.admitted), first
        if first.admitted:
            self.in_flight[qos_class] += 1
            return (qos_class, first.lease_id, cost)
        return multiple()

    @rule(target=waiters, qos_class=st.sampled_from(CLASSES), cost=COSTS)
    def acquire_or_wait(self, qos_class: str, cost: int) -> Any:
        """With a wait: admitted, refused, or queued behind the class's waiters."""
        spec = self.lease(qos_class, cost)
        cls = self.stores.classes[qos_class]
        answers = self.stores.each(
            lambda store: store.acquire(self.stores.pool, cls, spec, MAX_WAIT_MS)
        )
        same_decision(answers)
        first = answers[0]
        if first.queued:
            self.queued[qos_class] += 1
            waiter = Waiter(qos_class, float(cost), spec)
            self.pending.append(waiter)
            return waiter
        if first.admitted:
            self.in_flight[qos_class] += 1
        return multiple()

    @rule(
        target=leases,
        lease=consumes(leases),
        used_per_cost=USED_PER_COST,
        outcome=st.sampled_from([Outcome.OK, Outcome.ERROR, Outcome.CANCELLED]),
        twice=st.booleans(),
    )
    def release(
        self, lease: tuple[str, str, int], used_per_cost: float, outcome: Outcome, twice: bool
    ) -> Any:
        """Settled against the real count: the same charge and refund everywhere; a
        second release of the same lease settles nothing. Then the waiters are
        pumped, in arrival order."""
        qos_class, lease_id, cost = lease
        cls = self.stores.classes[qos_class]
        usage = UsageReport(int(cost * used_per_cost), 0, outcome)
        for attempt in range(2 if twice else 1):
            settled = self.stores.each(
                lambda store: store.release(self.stores.pool, cls, lease_id, usage)
            )
            for other in settled[1:]:
                assert other.already_released == settled[0].already_released, settled
                assert other.charged == pytest.approx(settled[0].charged, abs=1e-6), settled
                assert other.adjustment == pytest.approx(settled[0].adjustment, abs=1e-6)
            assert settled[0].already_released == (attempt == 1)
        self.in_flight[qos_class] -= 1
        return self.let_in(list(self.pending))

    @rule(target=leases, data=st.data())
    def pump(self, data: st.DataObject) -> Any:
        """Waiters let in, in the same fleet-wide order, everywhere, whatever order
        the daemon asks in."""
        return self.let_in(data.draw(st.permutations(self.pending)))

    def let_in(self, asked: list[Waiter]) -> Any:
        """One pump of ``asked`` on every store; the leases it admitted, for release.
        Also run after each release and rate change, as the waiting room does when
        budget comes back: that is when waiters get in at these rates."""
        if not asked:
            return multiple()
        results = self.stores.each(lambda store: store.pump(self.stores.pool, asked))
        for other in results[1:]:
            assert [r.state for r in other] == [r.state for r in results[0]], results
            for mine, theirs in zip(results[0], other, strict=True):
                if mine.decision is not None:
                    assert theirs.decision is not None
                    same_decision([mine.decision, theirs.decision])
        admitted = []
        for waiter, result in zip(asked, results[0], strict=True):
            if result.state is WaiterState.ADMITTED:
                assert result.decision is not None
                self.pending.remove(waiter)
                self.queued[waiter.qos_class] -= 1
                self.in_flight[waiter.qos_class] += 1
                admitted.append((waiter.qos_class, result.decision.lease_id, int(waiter.cost)))
        self.pumped_in += len(admitted)
        return multiple(*admitted)

    @rule(waiter=consumes(waiters))
    def cancel(self, waiter: Waiter) -> None:
        if waiter in self.pending:
            self.stores.each(lambda store: store.cancel(self.stores.pool, [waiter]))
            self.pending.remove(waiter)
            self.queued[waiter.qos_class] -= 1

    @rule(target=leases, factor=st.sampled_from([0.5, 2.0]), pin=st.booleans())
    def change_rate(self, factor: float, pin: bool) -> Any:
        """A rate change (the SLO loop's, or an operator's pin): the same record."""
        records = self.stores.each(lambda store: store.control(self.stores.pool))
        base = records[0]
        changed = dataclasses.replace(
            base, capacity=base.capacity * factor, pinned=pin, reason="differential"
        )
        done = self.stores.each(lambda store: store.adjust(self.stores.pool, changed, 0))
        assert len(set(done)) == 1, done
        return self.let_in(list(self.pending))

    @rule(
        server=st.sampled_from(["gpu-a", "gpu-b"]),
        waiting=st.one_of(st.none(), st.integers(0, 6)),
        kv_usage=st.one_of(st.none(), st.floats(0, 1)),
    )
    def report_load(self, server: str, waiting: int | None, kv_usage: float | None) -> None:
        """A model server's gauges: a gated pool past its servers' waiting bound lets
        only the top class in, on every store alike (check_state compares the load)."""
        loads = [ServerLoad(server, waiting, kv_usage)]
        self.stores.each(lambda store: store.report_load(self.stores.pool, loads))

    @rule(
        qos_class=st.sampled_from(CLASSES),
        ttft=st.one_of(st.none(), st.floats(0, 10_000)),
        output=st.integers(0, 4_000),
        status=st.sampled_from([Outcome.OK, Outcome.ERROR]),
    )
    def report(self, qos_class: str, ttft: float | None, output: int, status: Outcome) -> None:
        """Latency samples: every store keeps the same newest few of each window."""
        sample = Sample("default", qos_class, "tenant", ttft, 25.0, None, 100, output, status)
        self.stores.each(lambda store: store.report([sample], REPORT_WINDOW))
        windows = self.stores.each(lambda store: store.window("default", qos_class))
        kept = [[dataclasses.replace(s, at_ms=0) for s in window] for window in windows]
        assert all(window == kept[0] for window in kept), windows
        assert len(kept[0]) <= REPORT_WINDOW

    @invariant()
    def check_state(self) -> None:
        statuses = self.stores.each(lambda store: store.status(self.stores.pool))
        same_status(statuses)
        status = statuses[0]
        for name, cls in status.classes.items():
            # Never above the burst. (Below zero there is no fixed bound: each
            # settlement moves a bucket by at most its burst, but underestimates
            # settled one after another add up to a debt that refill repays.)
            assert cls.tokens <= cls.burst + 1e-6, (name, cls)
            assert cls.in_flight == self.in_flight[name], (name, cls, self.in_flight)
            assert cls.waiting == self.queued[name], (name, cls, self.queued)


def machine(redis: dict[str, Any] | None, gated: bool, examples: int) -> type[Budgets]:
    class Configured(Budgets):
        pass

    Configured.redis = redis
    Configured.gated = gated
    Configured.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    return Configured


# Examples per run. The rules are one copy, so a divergence can only come from the
# runtimes or the keyspaces, which every example exercises; the cluster adds routing,
# so fewer do there. The embedded run checks the scripts' invariants in the fast tier
# (about 10 s each here). QOSD_DIFFERENTIAL_EXAMPLES sets all three, for a longer
# search by hand.
EXAMPLES = {"embedded": 100, "redis": 120, "cluster": 40}


def examples(backend: str) -> int:
    return int(os.environ.get("QOSD_DIFFERENTIAL_EXAMPLES", EXAMPLES[backend]))


@pytest.mark.fast
@pytest.mark.parametrize("gated", [False, True], ids=["rate", "gated"])
def test_the_embedded_store_keeps_its_invariants(gated: bool) -> None:
    machine(None, gated, examples("embedded")).TestCase().runTest()


@pytest.mark.parametrize("gated", [False, True], ids=["rate", "gated"])
@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_the_redis_scripts_agree_with_the_embedded_store(
    backend: str, gated: bool, request: pytest.FixtureRequest
) -> None:
    if backend == "redis":
        redis = {"url": request.getfixturevalue("redis_standalone").url}
    else:
        redis = {"url": request.getfixturevalue("redis_cluster3").url, "mode": "cluster"}
    machine(redis, gated, examples(backend)).TestCase().runTest()
