"""What only the Redis store has to get right: one round trip, one hash slot per pool,
scripts that come back after a flush, cluster redirects, admissions whose caller went
away while the script was in flight, batches Redis runs too late, clean closing, and
clocks that step back."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from qosd.config import (
    Config,
    ConfigError,
    RedisConfig,
    RedisMode,
    load_config,
)
from qosd.model import LeaseSpec, Outcome, StoreUnavailable, UsageReport, new_lease_token
from qosd.policy import ClassPolicy, PoolPolicy, resolve_pools
from qosd.server import start
from qosd.store.redis import RedisStore
from qosd_client import LatencySample, QosdClient, Reason
from qosd_harness import (
    RedisCluster,
    RedisServer,
    closed_port,
    redis_command,
    redis_server,
)
from tests.conftest import BASE_CONFIG, TEST_REDIS_TIMEOUT_MS, merge
from tests.waiting import unread_bytes, until


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


class Monitor:
    """Records the commands a Redis server receives from clients (not from scripts)."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url)
        self.commands: list[str] = []
        self._ready = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self._client.monitor() as monitor:  # type: ignore[no-untyped-call]
            self._ready.set()
            for event in monitor.listen():
                if self._stop and "PING" in event["command"]:
                    return
                if event.get("client_type") != "lua":
                    self.commands.append(event["command"])

    def __enter__(self) -> Monitor:
        self._thread.start()
        assert self._ready.wait(5), "MONITOR did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._client.ping()
        self._thread.join(5)
        self._client.close()


async def test_uncontended_acquire_is_one_round_trip(own_redis: RedisServer) -> None:
    # The SLO loop is another client of the same Redis (its turns write the pool's
    # learned prefill state); the test counts what one Acquire sends.
    config = merge(
        BASE_CONFIG,
        {"redis": {"url": own_redis.url, "key_prefix": "rt"}, "control": {"enabled": False}},
    )
    daemon = await start(Config.model_validate(config))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            await qos.acquire("P1", 10)  # connections open, scripts known
            with Monitor(own_redis.url) as monitor:  # listening once entered
                result = await qos.acquire("P1", 10, request_id="one-trip")
                # The release is a fence: it is sent once the Acquire is answered,
                # so whatever the Acquire made the daemon send reached Redis first.
                released = await qos.release(result.lease_id)
                assert await until(lambda: len(scripts_seen(monitor)) >= 2)
        assert result.admitted and not released.already_released
        # Only the daemon talks to this server, apart from the monitor's own handshakes.
        sent = [c for c in monitor.commands if not c.startswith(("PING", "MONITOR", "HELLO"))]
        print(f"\ncommands seen for one Acquire and its Release: {[c[:60] for c in sent]}")
        assert len(sent) == 2  # one script call each, nothing between or after
        assert all(c.startswith("EVALSHA") for c in sent)
        assert sent[0] != sent[1]
    finally:
        await daemon.stop(0)


def scripts_seen(monitor: Monitor) -> list[str]:
    return [c for c in monitor.commands if c.startswith("EVALSHA")]


def keys_with_prefix(url: str, prefix: str, cluster: bool) -> list[str]:
    if cluster:
        client: Any = redis.cluster.RedisCluster.from_url(url)
        keys = [k.decode() for k in client.scan_iter(f"{prefix}:*", target_nodes="all")]
    else:
        client = redis.Redis.from_url(url)
        keys = [k.decode() for k in client.scan_iter(f"{prefix}:*")]
    client.close()
    return keys


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_every_key_of_a_pool_shares_one_slot(backend: Any) -> None:
    settings = dict(backend.redis)
    extra = {
        "redis": settings,
        "pools": {
            "alpha": {"capacity_tokens_s": 10_000},
            "beta": {"capacity_tokens_s": 10_000},
        },
        "default_pool": None,
    }
    daemon = await start(Config.model_validate(merge(BASE_CONFIG, extra)))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            for pool in ("alpha", "beta"):
                for qos_class in ("P0", "P1", "P2"):
                    lease = await qos.acquire(
                        qos_class, 10, model=pool, request_id=f"{pool}-{qos_class}"
                    )
                    await qos.release(lease.lease_id, input_tokens=5)
                await qos.report([LatencySample(pool, "P0", e2e_ms=1.0)])
        keys = keys_with_prefix(settings["url"], settings["key_prefix"], backend.name == "cluster")
    finally:
        await daemon.stop(0)
    after = keys_with_prefix(settings["url"], settings["key_prefix"], backend.name == "cluster")
    assert set(keys) - set(after) == {f"{settings['key_prefix']}:{{control}}:leader"}
    by_pool: dict[str, set[int]] = {}
    for key in keys:
        pool = key.split("{", 1)[1].split("}", 1)[0]
        by_pool.setdefault(pool, set()).add(key_slot(key.encode()))
    kinds = sorted({key.split("}:", 1)[1].split(":", 1)[0] for key in keys})
    print(f"\n{len(keys)} keys, kinds {kinds}, slots per pool {by_pool}")
    assert kinds == ["leader", "leases", "req", "state", "window"]
    # The SLO loop's leader lease is the fleet's, in a slot of its own, and handed back
    # when the daemon stops.
    assert set(by_pool) == {"alpha", "beta", "control"}
    assert all(len(slots) == 1 for slots in by_pool.values())


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_scripts_come_back_after_a_flush(backend: Any) -> None:
    daemon = await start(Config.model_validate(merge(BASE_CONFIG, {"redis": backend.redis})))
    url = backend.redis["url"]
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            assert (await qos.acquire("P1", 10)).admitted
            if backend.name == "cluster":
                cluster: Any = redis.cluster.RedisCluster.from_url(url)
                for node in cluster.get_primaries():
                    redis.Redis(host=node.host, port=node.port).script_flush()
                cluster.close()
            else:
                redis.Redis.from_url(url).script_flush()
            lease = await qos.acquire("P1", 10)  # NOSCRIPT, load, retry: invisible
            assert lease.admitted
            assert not (await qos.release(lease.lease_id)).already_released
    finally:
        await daemon.stop(0)


@pytest.fixture
async def cluster_store(redis_cluster3: RedisCluster) -> AsyncIterator[RedisStore]:
    config = RedisConfig(
        url=redis_cluster3.url,
        mode=RedisMode.CLUSTER,
        key_prefix=f"t{uuid.uuid4().hex[:12]}",
        timeout_ms=TEST_REDIS_TIMEOUT_MS,  # the subject is a moved slot, not an outage
    )
    store = RedisStore(config, tombstone_ms=60_000)
    await store.start()
    yield store
    await store.close()


def policies(config: Config, qos_class: str) -> tuple[PoolPolicy, ClassPolicy]:
    pool = resolve_pools(config)["default"]
    return pool, next(cls for cls in pool.classes if cls.name == qos_class)


async def class_tokens(store: RedisStore, pool: PoolPolicy, qos_class: str) -> float:
    return (await store.status(pool)).classes[qos_class].tokens


def lease_spec(pool: str, qos_class: str, cost: int) -> LeaseSpec:
    """A lease the scripts price at ``cost``: its prompt tokens, at weight 1 (the
    pool's output weight is 0)."""
    return LeaseSpec(
        lease_id=f"{pool}:{qos_class}:{new_lease_token()}",
        request_id="",
        tenant="",
        input_tokens=cost,
        output_tokens=0,
        weight=1.0,
        ttl_ms=60_000,
    )


def move_slot(cluster: RedisCluster, slot: int) -> tuple[RedisServer, RedisServer]:
    """Reshards ``slot`` to another node as ``redis-cli --cluster reshard`` does:
    IMPORTING and MIGRATING, its keys MIGRATEd, then every node told the new owner.
    Returns the old owner and the new one."""
    by_port = {node.port: node for node in cluster.nodes}
    ids = {node.port: str(redis_command(node.port, "CLUSTER", "MYID")) for node in cluster.nodes}
    [owner_port] = [
        int(entry[2][1])
        for entry in redis_command(cluster.nodes[0].port, "CLUSTER", "SLOTS")
        if int(entry[0]) <= slot <= int(entry[1])
    ]
    source = by_port[owner_port]
    target = next(node for node in cluster.nodes if node is not source)
    s = str(slot)
    setslot = ("CLUSTER", "SETSLOT", s)
    assert redis_command(target.port, *setslot, "IMPORTING", ids[source.port]) == "OK"
    assert redis_command(source.port, *setslot, "MIGRATING", ids[target.port]) == "OK"
    keys = [str(k) for k in redis_command(source.port, "CLUSTER", "GETKEYSINSLOT", s, "1000")]
    assert keys, "the pool's keys live in the slot"
    moved = redis_command(
        source.port, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys
    )
    assert moved == "OK", moved
    for node in [target, source, *(n for n in cluster.nodes if n not in (source, target))]:
        assert redis_command(node.port, *setslot, "NODE", ids[target.port]) == "OK"
    return source, target


async def test_cluster_follows_a_slot_that_moved(
    cluster_store: RedisStore, redis_cluster3: RedisCluster
) -> None:
    pool, policy = policies(Config.model_validate(BASE_CONFIG), "P1")
    started = time.monotonic()
    first = await cluster_store.acquire(pool, policy, lease_spec("default", "P1", 100), 0)
    assert first.admitted
    state_key = cluster_store._args_for(pool).keys[0]
    source, target = move_slot(redis_cluster3, key_slot(state_key.encode()))
    # The store's next call goes to the old owner, which answers MOVED.
    decision = await cluster_store.acquire(pool, policy, lease_spec("default", "P1", 100), 0)
    took = time.monotonic() - started
    assert decision.admitted
    # The same bucket: both charges taken from it, refilled by at most the time the
    # calls and the move took (a new bucket would stand at 1500 - 100).
    assert 1500 - 200 - 1 <= decision.remaining <= 1500 - 200 + policy.rate * took + 1
    assert redis_command(target.port, "EXISTS", state_key) == 1
    assert str(redis_command(source.port, "EXISTS", state_key)).startswith("MOVED")


BUSY_SCRIPT = """
redis.log(redis.LOG_WARNING, ARGV[2])
local started = redis.call('TIME')
local until_us = started[1] * 1000000 + started[2] + tonumber(ARGV[1]) * 1000
repeat
  local now = redis.call('TIME')
until now[1] * 1000000 + now[2] >= until_us
return 1
"""


def block_redis(url: str, milliseconds: int, marker: str = "busy") -> None:
    """Keeps a Redis server busy for a while, as a slow command or a pause would; its
    log says ``marker`` when that begins."""
    client = redis.Redis.from_url(url)
    try:
        client.eval(BUSY_SCRIPT, 0, milliseconds, marker)
    finally:
        client.close()


async def busy(server: RedisServer, milliseconds: int) -> asyncio.Task[None]:
    """Starts keeping ``server`` busy; returns the blocker once Redis runs it."""
    marker = f"qosd-test busy {uuid.uuid4().hex}"
    log = server.directory / "redis.log"
    blocker = asyncio.create_task(asyncio.to_thread(block_redis, server.url, milliseconds, marker))
    started = await until(lambda: marker in log.read_text(errors="replace"))  # it logs so
    assert started, "the busy script never ran"
    return blocker


async def waits_unread(server: RedisServer, within_s: float) -> None:
    """Returns once a call has reached ``server`` and waits there, unread."""
    reached = await until(lambda: unread_bytes(server.port) > 0, timeout_s=within_s)
    assert reached, "the call did not reach Redis while it was busy"


def read_lease(url: str, cluster: bool, prefix: str, lease_id: str) -> str | None:
    _, qos_class, token = lease_id.split(":")
    lease_hash = f"{prefix}:{{default}}:leases:{token[:8]}"
    client: Any = redis.cluster.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    try:
        value = client.hget(lease_hash, f"{qos_class}:{token}")
    finally:
        client.close()
    return None if value is None else str(value.decode())


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_admission_of_a_departed_caller_is_refunded_exactly(
    backend: Any, redis_standalone: RedisServer
) -> None:
    """A caller cancelled while its script call is in flight: the admission is undone,
    refunding the whole charge, even one above the burst."""
    settings = {**backend.redis, "timeout_ms": 2_000}
    extra = {"redis": settings, "classes": {"P1": {"max_cost_tokens": 3_000}}}
    config = Config.model_validate(merge(BASE_CONFIG, extra))
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    try:
        pool, policy = policies(config, "P1")
        warm = await store.acquire(pool, policy, lease_spec("default", "P1", 10), 0)
        await store.release(pool, policy, warm.lease_id, UsageReport(10, 0, Outcome.OK))
        blocker = await busy(redis_standalone, 300)  # Redis is busy now
        spec = lease_spec("default", "P1", 2_500)
        call = asyncio.create_task(store.acquire(pool, policy, spec, 0))
        await waits_unread(redis_standalone, 0.3)  # sent: waiting behind the busy script
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await blocker

        def lease() -> str | None:
            return read_lease(settings["url"], False, settings["key_prefix"], spec.lease_id)

        await until(lambda: (lease() or "").startswith("R|"))  # settled (R: released)
        settled = lease()
        # It really was admitted, then settled as cancelled with the whole charge back.
        assert settled == "R|0|-2500|3"
        assert await class_tokens(store, pool, "P1") == pytest.approx(1500)
    finally:
        await store.close()


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_departed_caller_with_request_id_is_undone_and_its_retry_admitted(
    backend: Any, redis_standalone: RedisServer
) -> None:
    """With a request id too, an admission nobody was told of is undone, and its id
    freed: the caller's retry is a new request, admitted and charged once (the first
    admission was refunded), not turned away as a duplicate of a grant it never got."""
    settings = {**backend.redis, "timeout_ms": 2_000}
    config = Config.model_validate(merge(BASE_CONFIG, {"redis": settings}))
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    try:
        pool, policy = policies(config, "P1")
        blocker = await busy(redis_standalone, 300)
        spec = dataclasses.replace(lease_spec("default", "P1", 600), request_id="retry-me")
        call = asyncio.create_task(store.acquire(pool, policy, spec, 0))
        await waits_unread(redis_standalone, 0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await blocker

        def lease() -> str | None:
            return read_lease(settings["url"], False, settings["key_prefix"], spec.lease_id)

        await until(lambda: (lease() or "").startswith("R|"))  # settled (R: released)
        # It really was admitted, then settled as cancelled with the whole charge back.
        assert lease() == "R|0|-600|3"
        assert await class_tokens(store, pool, "P1") == pytest.approx(1500)
        retry = dataclasses.replace(lease_spec("default", "P1", 600), request_id="retry-me")
        again = await store.acquire(pool, policy, retry, 0)
        assert again.admitted and not again.duplicate and again.lease_id == retry.lease_id
        assert again.charged == 600 and again.remaining == pytest.approx(900, abs=1)
    finally:
        await store.close()


async def test_a_batch_redis_runs_after_its_timeout_charges_nothing(own_redis: RedisServer) -> None:
    """Redis paused past the callers' timeout, then resumed: the batch it then runs
    must not charge the budget of callers that were already told it failed."""
    config = Config.model_validate(
        merge(BASE_CONFIG, {"redis": {"url": own_redis.url, "timeout_ms": 100}})
    )
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    assert own_redis.process is not None
    try:
        pool, policy = policies(config, "P1")
        await store.acquire(pool, policy, lease_spec("default", "P1", 1), 0)  # clock
        await asyncio.sleep(0.4)  # refill to full
        os.kill(own_redis.process.pid, signal.SIGSTOP)
        try:
            calls = [
                store.acquire(pool, policy, lease_spec("default", "P1", 100), 0) for _ in range(5)
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            sent = unread_bytes(own_redis.port)
        finally:
            os.kill(own_redis.process.pid, signal.SIGCONT)
        assert all(isinstance(result, StoreUnavailable) for result in results)
        assert sent > 0  # the batch reached the stopped Redis, which runs it late ...
        assert await until(lambda: unread_bytes(own_redis.port) == 0)  # ... now: it has run
        assert await class_tokens(store, pool, "P1") == pytest.approx(1500)
        assert (await store.status(pool)).active_leases == 1  # the first one only
    finally:
        await store.close()


async def test_close_answers_queued_calls_and_refuses_new_ones(own_redis: RedisServer) -> None:
    config = Config.model_validate(merge(BASE_CONFIG, {"redis": {"url": own_redis.url}}))
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    pool, policy = policies(config, "P1")
    queued = asyncio.create_task(store.acquire(pool, policy, lease_spec("default", "P1", 10), 0))
    await asyncio.sleep(0)  # queued in the batcher, not sent yet
    await store.close()
    assert queued.done()
    assert queued.result().admitted  # answered before the connections closed
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.acquire(pool, policy, lease_spec("default", "P1", 10), 0)


async def test_a_bucket_stamped_in_the_future_is_not_refilled_twice(
    own_redis: RedisServer,
) -> None:
    """After a failover to a primary whose clock is behind, the pool's last update is
    in that primary's future: no refill until its clock passes it, and the stamp must
    not move back (or the skew would be refilled again later)."""
    config = Config.model_validate(
        merge(BASE_CONFIG, {"redis": {"url": own_redis.url, "key_prefix": "skew"}})
    )
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    client = redis.Redis.from_url(own_redis.url)
    try:
        seconds, micros = client.time()
        future_us = (seconds + 5) * 1_000_000 + micros
        client.hset(
            "skew:{default}:state",
            mapping={"u": future_us, "s": 0, "t:P0": 3000, "t:P1": 100, "t:P2": 500},
        )
        pool, policy = policies(config, "P1")
        decision = await store.acquire(pool, policy, lease_spec("default", "P1", 10), 0)
        assert decision.admitted and decision.remaining == pytest.approx(90)
        assert client.hget("skew:{default}:state", "u") == str(future_us).encode()
    finally:
        client.close()
        await store.close()


async def test_a_cluster_daemon_finds_the_cluster_through_its_seeds_when_its_node_is_down(
    redis_cluster3: RedisCluster,
) -> None:
    """A daemon started while the node its URL names is down (after a failover, say)
    reads the topology from the next seed, and admits; with no other seed it cannot."""
    with closed_port() as port:  # held closed: no other worker's Redis can answer there
        dead = f"redis://127.0.0.1:{port}/0"
        seeds = ",".join(f"127.0.0.1:{node.port}" for node in redis_cluster3.nodes)
        # The first call reads the topology through the seeds: on a busy machine that
        # takes more than the default 100 ms timeout, which is not the subject.
        base = {"QOSD_REDIS_URL": dead, "QOSD_REDIS_MODE": "cluster", "QOSD_LISTEN": "127.0.0.1:0",
                "QOSD_REDIS_TIMEOUT_MS": "5000"}  # fmt: skip
        for env, admitted in (({**base, "QOSD_REDIS_CLUSTER_SEEDS": seeds}, True), (base, False)):
            daemon = await start(
                load_config(env={**env, "QOSD_REDIS_KEY_PREFIX": uuid.uuid4().hex})
            )
            try:
                async with QosdClient(daemon.addresses[0]) as qos:
                    answer = await qos.acquire("P1", 10, timeout_s=30)
                assert answer.admitted is admitted, answer
                if not admitted:
                    assert answer.reason is Reason.BACKEND_UNAVAILABLE
            finally:
                await daemon.stop(0)


def test_cluster_seeds_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match="cluster_seeds: only with mode: cluster"):
        load_config(env={"QOSD_REDIS_URL": "redis://h:1", "QOSD_REDIS_CLUSTER_SEEDS": "h:2"})
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        load_config(
            env={
                "QOSD_REDIS_URL": "redis://h:1",
                "QOSD_REDIS_MODE": "cluster",
                "QOSD_REDIS_CLUSTER_SEEDS": "h:2,nohost",
            }
        )
    config = load_config(
        env={
            "QOSD_REDIS_URL": "redis://h:1",
            "QOSD_REDIS_MODE": "cluster",
            "QOSD_REDIS_CLUSTER_SEEDS": "h:2, [::1]:3",
        }
    )
    assert config.redis.cluster_seeds == ["h:2", "[::1]:3"]
