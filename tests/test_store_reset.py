"""A store that comes back empty (FLUSHALL, a Redis restarted without persistence) is
noticed by the pool epoch its replies carry, counted and logged by every daemon that
sees it, and the SLO loop's leader writes back the rates and pins it knew: an
operator's pin at 8,000 stays pinned at 8,000, and the buckets start empty rather than
handing out a full burst at the configured rate (docs/design.md, "When the store
comes back empty")."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from qosd.config import Config
from qosd.control.leader import _restorable
from qosd.model import ControlRecord, LeaseSpec, new_lease_token
from qosd.policy import resolve_pools
from qosd.server import Daemon, make_store
from qosd_client import QosdClient, Reason, Status
from qosd_harness import RedisCluster, RedisServer, redis_server
from tests.conftest import BASE_CONFIG, Backend, DaemonFactory, merge
from tests.waiting import eventually

# Turns come only when a reset wakes the loop (and once at start): what restores the
# pin is the reset seen on the Acquire path, not a turn that happened to come.
SLOW_LOOP = {"control": {"interval_s": 30, "leader_lease_s": 60}}
PINNED = 8_000.0


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def resets(daemon: Daemon, pool: str = "default") -> float:
    value = daemon.metrics.registry.get_sample_value("qosd_store_resets_total", {"pool": pool})
    return value or 0.0


def flushall(target: RedisServer | RedisCluster) -> None:
    nodes = target.nodes if isinstance(target, RedisCluster) else [target]
    for node in nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        client.flushall()
        client.close()


def pin_restored(status: Status) -> bool:
    pool = status.pool("default")
    return pool.pinned and pool.admitted_rate_tokens_s == PINNED


async def leads(admin: QosdClient, daemon: Daemon) -> Status:
    return await eventually(
        admin.status, lambda s: s.controller == daemon.admission.daemon_id, timeout_s=30
    )


async def pin_then_lose_the_store(
    make: DaemonFactory,
    target: RedisServer | RedisCluster,
    settings: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = await make(merge(SLOW_LOOP, {"redis": settings}))
    daemon = running.daemon
    assert (await leads(running.admin, daemon)).controller == daemon.admission.daemon_id
    pinned = await running.admin.pin_rate("default", PINNED)
    assert pinned.pinned and pinned.admitted_rate_tokens_s == PINNED
    assert (await running.client.acquire("P1", 10, max_wait_ms=0)).admitted
    assert resets(daemon) == 0

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        flushall(target)
        # The first Acquire after the loss creates the pool's state anew: empty, not a
        # full burst at the configured 10,000 tokens/s.
        first = await running.client.acquire("P1", 10, max_wait_ms=0)
        assert not first.admitted and first.reason is Reason.RATE_LIMITED, first
        assert first.remaining_tokens < 10
        # Its reply carried the new epoch: counted before the answer came back.
        assert resets(daemon) == 1
        # The reset woke the loop, which took the lease the flush removed and wrote
        # the pin back.
        status = await eventually(running.admin.status, pin_restored, timeout_s=20)
        assert pin_restored(status), status.pool("default")
        assert status.controller == daemon.admission.daemon_id
    pool = (await running.admin.status(history=3)).pool("default")
    assert pool.last_change is not None
    assert pool.last_change.reason == (
        f"restored after the store came back empty: pinned at {PINNED:.0f} tokens/s by an operator"
    )
    assert pool.last_change.to_tokens_s == PINNED
    detected = [r for r in caplog.records if "came back empty" in r.getMessage()]
    assert {r.levelno for r in detected} == {logging.WARNING}
    assert any(
        r.getMessage().startswith("pool default: store came back empty (epoch ")
        and r.getMessage().endswith(f"restoring rate {PINNED:.0f} tokens/s (pinned)")
        for r in detected
    ), [r.getMessage() for r in detected]
    # One loss, one count, however many calls see the new state afterwards.
    for _ in range(5):
        await running.client.acquire("P2", 1, max_wait_ms=0)
    await running.admin.status()
    assert resets(daemon) == 1
    assert 'qosd_store_resets_total{pool="default"} 1.0' in (await daemon.metrics_page()).decode()


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_a_pin_survives_flushall_standalone(
    make_daemon: DaemonFactory, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = {"url": own_redis.url, "mode": "standalone", "key_prefix": "reset"}
    await pin_then_lose_the_store(make_daemon, own_redis, settings, caplog)


@pytest.mark.parametrize("backend", ["cluster"], indirect=True)
async def test_a_pin_survives_flushall_on_a_cluster(
    make_daemon: DaemonFactory,
    redis_cluster3: RedisCluster,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = {"url": redis_cluster3.url, "mode": "cluster", "key_prefix": "reset"}
    await pin_then_lose_the_store(make_daemon, redis_cluster3, settings, caplog)


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_a_pin_survives_redis_restarted_empty(
    make_daemon: DaemonFactory, own_redis: RedisServer
) -> None:
    settings = {"url": own_redis.url, "mode": "standalone", "key_prefix": "restart"}
    running = await make_daemon(merge(SLOW_LOOP, {"redis": settings}))
    await leads(running.admin, running.daemon)
    await running.admin.pin_rate("default", PINNED)
    assert (await running.client.acquire("P1", 10, max_wait_ms=0)).admitted

    own_redis.restart()  # same port, nothing kept: no data, no scripts, no lease

    async def answered() -> Any:
        return await running.client.acquire("P1", 10, max_wait_ms=0)

    after = await eventually(
        answered, lambda r: r.reason is not Reason.BACKEND_UNAVAILABLE, timeout_s=20
    )
    assert after.reason is not Reason.BACKEND_UNAVAILABLE
    assert resets(running.daemon) == 1
    status = await eventually(running.admin.status, pin_restored, timeout_s=20)
    assert pin_restored(status), status.pool("default")


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_the_daemon_that_leads_after_the_loss_restores_what_it_read(
    make_daemon: DaemonFactory, own_redis: RedisServer
) -> None:
    """The pin was made through another daemon, which is gone: the one leading now
    restores the record it read, not one it wrote."""
    settings = {"url": own_redis.url, "mode": "standalone", "key_prefix": "handover"}
    quick = {"control": {"interval_s": 0.2, "leader_lease_s": 1}}
    first = await make_daemon(merge(quick, {"redis": settings}))
    second = await make_daemon(merge(quick, {"redis": settings}))
    await leads(first.admin, first.daemon)
    await first.admin.pin_rate("default", PINNED)
    await first.daemon.stop(0)  # hands the lease back: the second takes it

    def read_the_pin(status: Status) -> bool:
        return status.controller == second.daemon.admission.daemon_id and (
            status.pool("default").verdict == "pinned by an operator"
        )

    assert read_the_pin(await eventually(second.admin.status, read_the_pin, timeout_s=30))
    assert (await second.client.acquire("P1", 10, max_wait_ms=0)).admitted
    flushall(own_redis)
    await second.client.acquire("P1", 10, max_wait_ms=0)
    assert resets(second.daemon) == 1
    status = await eventually(second.admin.status, pin_restored, timeout_s=20)
    assert pin_restored(status), status.pool("default")


# -- the epoch on every backend, and the rule that reads it -------------------------


async def test_the_epoch_is_set_once_when_the_state_is_made(backend: Backend) -> None:
    tree = merge(BASE_CONFIG, {})
    if backend.redis is not None:
        tree["redis"] = backend.redis
    config = Config.model_validate(tree)
    pool = resolve_pools(config)["default"]
    cls = pool.classes[1]
    store = make_store(config, "d")
    seen: list[tuple[str, str, str]] = []
    store.add_reset_listener(lambda *reset: seen.append(reset))
    await store.start()
    try:
        assert (await store.control(pool)).epoch == ""  # no state yet
        lease = LeaseSpec(f"default:{cls.name}:{new_lease_token()}", "", "", 10, 0, 1.0, 60_000)
        assert (await store.acquire(pool, cls, lease, 0)).admitted
        record = await store.control(pool)
        assert record.epoch and record.record_epoch == ""  # the record was never written
        cut = dataclasses.replace(record, capacity=8_000, reason="cut", changed_by="d")
        assert await store.adjust(pool, cut, cooldown_ms=0)
        after = await store.control(pool)
        assert after.epoch == record.epoch and after.record_epoch == record.epoch
        assert after.capacity == 8_000
        assert seen == []  # the same state throughout: no reset
    finally:
        await store.close()


def record(epoch: str, record_epoch: str = "", pinned: bool = True) -> ControlRecord:
    return ControlRecord(
        PINNED, pinned, 1_000, "pinned", 10_000, "a", 0.0, 1, PINNED, 0, 0.0, epoch, record_epoch
    )


def test_only_a_lost_record_nobody_rewrote_is_restored() -> None:
    known = record("x", "x")
    assert _restorable(None, record("y")) is None  # nothing known: nothing to restore
    assert _restorable(known, record("x", "x")) is None  # the same state
    assert _restorable(known, record("")) is known  # lost, not made anew yet
    assert _restorable(known, record("y")) is known  # made anew by an Acquire
    # Written since the state was made anew (a restore, a pin): it stands.
    assert _restorable(known, record("y", "y")) is None
    # A control hash that outlived the state (its e is the old epoch) is not a restore.
    assert _restorable(known, record("y", "x")) is known
