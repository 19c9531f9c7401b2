"""Races and damage the waiting room must survive, at the store and waiting-room level:
grants that lose to a timeout, pumps Redis runs too late, records gone missing,
queues full of waiters stepping aside, and a store lost while waiters join."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis

from qosd.config import Config
from qosd.model import (
    BucketDecision,
    LeaseSpec,
    Outcome,
    PumpResult,
    Reason,
    StoreUnavailable,
    UsageReport,
    Waiter,
    new_lease_token,
)
from qosd.policy import ClassPolicy, PoolPolicy, resolve_pools
from qosd.store.base import BucketStore
from qosd.store.embedded import EmbeddedStore
from qosd.store.redis import RedisStore
from qosd.waiting import WaitingRoom
from qosd_harness import RedisServer, redis_server
from tests.conftest import BASE_CONFIG, merge
from tests.waiting import unread_bytes, until


def pool_policy(extra: dict[str, Any] | None = None) -> PoolPolicy:
    return resolve_pools(Config.model_validate(merge(BASE_CONFIG, extra or {})))["default"]


def class_of(pool: PoolPolicy, name: str) -> ClassPolicy:
    return next(cls for cls in pool.classes if cls.name == name)


def lease(qos_class: str, cost: int, request_id: str = "", tenant: str = "") -> LeaseSpec:
    """A lease the scripts price at ``cost``: its prompt tokens, at weight 1 (the
    pool's output weight is 0)."""
    return LeaseSpec(
        f"default:{qos_class}:{new_lease_token()}", request_id, tenant, cost, 0, 1.0, 60_000
    )


@pytest.fixture
def own_redis() -> Any:
    with redis_server() as server:
        yield server


@pytest.fixture(params=["embedded", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[BucketStore]:
    if request.param == "embedded":
        yield EmbeddedStore(tombstone_ms=60_000)
        return
    server: RedisServer = request.getfixturevalue("redis_standalone")
    config = Config.model_validate(
        merge(BASE_CONFIG, {"redis": {"url": server.url, "key_prefix": f"t{uuid.uuid4().hex[:8]}"}})
    )
    redis_store = RedisStore(config.redis, tombstone_ms=60_000)
    await redis_store.start()
    yield redis_store
    await redis_store.close()


class SlowPumps:
    """A store whose pump answers arrive late: as on a busy network."""

    def __init__(self, inner: BucketStore, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.answered = asyncio.Event()  # a pump's answer has reached the room

    async def pump(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> list[PumpResult]:
        results = await self.inner.pump(pool, waiters)
        await asyncio.sleep(self.delay_s)  # the busy network
        self.answered.set()
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def no_store(pool: PoolPolicy, waiter: Waiter) -> BucketDecision:
    return BucketDecision(False, Reason.BACKEND_UNAVAILABLE, "", waiter.cost, 0.0, 500, 0)


async def test_grant_losing_to_a_timeout_is_undone_and_frees_its_request_id(
    store: BucketStore,
) -> None:
    """The caller timed out, but its grant landed: nobody will use it, so the room undoes
    it (settled as cancelled, nothing used) and frees its request id, so that the
    caller's retry is a new request and is not turned away as a duplicate of a grant it
    never got."""
    pool = pool_policy()
    p1 = class_of(pool, "P1")
    assert (await store.acquire(pool, p1, lease("P1", 1_500), 0)).admitted  # drained
    slow = SlowPumps(store, 0.08)
    room = WaitingRoom(slow, 0.005, no_store)
    first = lease("P1", 150, request_id="req-7")
    queued = await store.acquire(pool, p1, first, 400)  # fits after ~50 ms
    assert queued.queued
    await asyncio.sleep(0.06)  # it fits now: the first pump grants it, but answers late
    answer = await room.wait(pool, Waiter("P1", 150, first), 0.04)
    assert answer.reason is Reason.QUEUE_TIMEOUT
    await asyncio.wait_for(slow.answered.wait(), 5)  # the late grant has landed ...
    await room.close()  # ... and the room's undo of it is done
    # The grant was settled already, as a cancelled request that used nothing ...
    usage = UsageReport(150, 0, Outcome.OK)
    settled = await store.release(pool, p1, first.lease_id, usage)
    assert settled.already_released and settled.charged == 0
    # ... and its request id is free: the retry is admitted as a request of its own.
    retry = await store.acquire(pool, p1, lease("P1", 150, request_id="req-7"), 0)
    assert retry.admitted and not retry.duplicate and retry.lease_id != first.lease_id
    assert retry.charged == 150


async def test_waiters_joining_a_failed_pump_are_answered_too() -> None:
    """A pump that fails answers every waiter of the pool by the fail mode, including
    those that joined while it was in flight, instead of leaving them unpumped."""

    pumping = asyncio.Event()

    class FailingStore(EmbeddedStore):
        async def pump(self, *args: Any, **kwargs: Any) -> list[PumpResult]:
            pumping.set()
            await asyncio.sleep(0.05)  # a store slow to fail
            raise StoreUnavailable("redis: gone")

    store = FailingStore(tombstone_ms=60_000)
    pool = pool_policy()
    room = WaitingRoom(store, 0.005, no_store)
    first = asyncio.create_task(room.wait(pool, Waiter("P1", 10, lease("P1", 10)), 5.0))
    await asyncio.wait_for(pumping.wait(), 5)  # the pump is in flight
    second = asyncio.create_task(room.wait(pool, Waiter("P1", 10, lease("P1", 10)), 5.0))
    answers = await asyncio.wait_for(asyncio.gather(first, second), 1.0)
    assert [answer.reason for answer in answers] == [Reason.BACKEND_UNAVAILABLE] * 2
    await room.close()


async def test_a_pump_that_fails_once_loses_no_waiter() -> None:
    """One failed pump (a timeout on a CPU-starved replica) is retried: the waiters
    stay queued and are admitted by the next pump, not answered by the fail mode."""

    class FailsOnce(EmbeddedStore):
        failures = 0

        async def pump(self, *args: Any, **kwargs: Any) -> list[PumpResult]:
            if not self.failures:
                self.failures += 1
                raise StoreUnavailable("redis: timed out")
            return await super().pump(*args, **kwargs)

    store = FailsOnce(tombstone_ms=60_000)
    pool = pool_policy()
    p1 = class_of(pool, "P1")
    assert (await store.acquire(pool, p1, lease("P1", 1_500), 0)).admitted  # drained
    # A third of a second of P1's refill each: queued however slowly the calls come
    # (10 tokens each, 3 ms of refill, were admitted outright on a busy machine).
    waiters = [Waiter("P1", 1_000, lease("P1", 1_000)) for _ in range(3)]
    for waiter in waiters:
        assert (await store.acquire(pool, p1, waiter.lease, 5_000)).queued
    room = WaitingRoom(store, 0.005, no_store, store_patience_s=5.0)
    answers = await asyncio.wait_for(
        asyncio.gather(*(room.wait(pool, waiter, 5.0) for waiter in waiters)), 4.0
    )
    assert store.failures == 1
    assert [answer.admitted for answer in answers] == [True] * 3
    await room.close()


async def test_waiters_get_the_fail_mode_answer_once_the_store_stays_away() -> None:
    """Pumps failing for the whole patience answer every waiter by the fail mode, and a
    waiter whose own deadline comes first while the store is away gets it too (not
    QUEUE_TIMEOUT: the store, not the queue, kept it out)."""

    class AlwaysFails(EmbeddedStore):
        pumps = 0

        async def pump(self, *args: Any, **kwargs: Any) -> list[PumpResult]:
            self.pumps += 1
            raise StoreUnavailable("redis: gone")

    store = AlwaysFails(tombstone_ms=60_000)
    pool = pool_policy()
    room = WaitingRoom(store, 0.005, no_store, store_patience_s=0.3)
    loop = asyncio.get_running_loop()
    began = loop.time()
    short = asyncio.create_task(room.wait(pool, Waiter("P1", 10, lease("P1", 10)), 0.1))
    patient = asyncio.create_task(room.wait(pool, Waiter("P1", 10, lease("P1", 10)), 30.0))
    assert (await asyncio.wait_for(short, 5.0)).reason is Reason.BACKEND_UNAVAILABLE
    assert (await asyncio.wait_for(patient, 5.0)).reason is Reason.BACKEND_UNAVAILABLE
    assert loop.time() - began >= 0.3  # it sat through the patience first ...
    assert store.pumps >= 2  # ... retrying the store meanwhile
    await room.close()


async def test_waiter_behind_many_tenant_blocked_ones_still_gets_in(store: BucketStore) -> None:
    """Waiters stepping aside for their tenant's ceiling are looked past (up to 64), so
    the waiter behind them is the class's head and is admitted in turn."""
    pool = pool_policy({"classes": {"P1": {"tenant_max_share": 0.01}}})  # 100 tokens/s each
    p1 = class_of(pool, "P1")
    blocked: list[Waiter] = []
    for index in range(12):  # 12 tenants, each over its ceiling after one request
        tenant = f"busy-{index}"
        assert (await store.acquire(pool, p1, lease("P1", 50, tenant=tenant), 0)).admitted
        spec = lease("P1", 50, tenant=tenant)
        assert (await store.acquire(pool, p1, spec, 5_000)).queued
        blocked.append(Waiter("P1", 50, spec))
    patient = lease("P1", 50, tenant="patient")
    decision = await store.acquire(pool, p1, patient, 5_000)
    # It may not overtake live waiters, but blocked ones hold nobody up: admitted now.
    assert decision.admitted or decision.queued
    if decision.queued:
        results = await store.pump(pool, [*blocked, Waiter("P1", 50, patient)])
        assert results[-1].decision is not None and results[-1].decision.admitted
    await store.cancel(pool, blocked)


async def test_a_pump_redis_runs_too_late_charges_nothing(own_redis: RedisServer) -> None:
    config = Config.model_validate(
        merge(BASE_CONFIG, {"redis": {"url": own_redis.url, "timeout_ms": 100}})
    )
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    pool = resolve_pools(config)["default"]
    p1 = class_of(pool, "P1")
    assert own_redis.process is not None
    try:
        assert (await store.acquire(pool, p1, lease("P1", 1_500), 0)).admitted
        spec = lease("P1", 100)
        assert (await store.acquire(pool, p1, spec, 5_000)).queued
        await asyncio.sleep(0.1)  # enough tokens for it now
        os.kill(own_redis.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailable):
                await store.pump(pool, [Waiter("P1", 100, spec)])
            sent = unread_bytes(own_redis.port)
        finally:
            os.kill(own_redis.process.pid, signal.SIGCONT)
        assert sent > 0  # the pump reached the stopped Redis, which runs it late ...
        assert await until(lambda: unread_bytes(own_redis.port) == 0)  # ... now: it has run
        assert (await store.status(pool)).active_leases == 1  # only the first one
        status = await store.status(pool)
        assert status.classes["P1"].waiting == 1  # still waiting: nothing was done
    finally:
        await store.close()


async def test_a_queue_entry_without_its_record_is_dropped_not_fatal(
    own_redis: RedisServer,
) -> None:
    config = Config.model_validate(
        merge(BASE_CONFIG, {"redis": {"url": own_redis.url, "key_prefix": "nil"}})
    )
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    pool = resolve_pools(config)["default"]
    p1 = class_of(pool, "P1")
    client = redis.Redis.from_url(own_redis.url)
    try:
        assert (await store.acquire(pool, p1, lease("P1", 1_500), 0)).admitted
        specs = [lease("P1", 500) for _ in range(3)]
        for spec in specs:
            assert (await store.acquire(pool, p1, spec, 5_000)).queued
        lost = Waiter("P1", 500, specs[0])
        client.hdel("nil:{default}:waiters", lost.id)  # e.g. evicted under memory pressure
        results = await store.pump(pool, [Waiter("P1", 500, s) for s in specs[1:]])
        assert [r.state.name for r in results] == ["WAITING", "WAITING"]  # no script error
        assert (await store.status(pool)).classes["P1"].waiting == 2  # count repaired
        await store.cancel(pool, [Waiter("P1", 500, s) for s in specs[1:]])
        assert client.zcard("nil:{default}:queue:P1") == 0
    finally:
        client.close()
        await store.close()
