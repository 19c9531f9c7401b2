"""What only the Redis store has to get right: one round trip, one hash slot per pool,
scripts that come back after a flush, cluster redirects, and admissions whose caller
went away while the script was in flight."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from qosd.config import Config, RedisConfig, RedisMode, resolve_policies
from qosd.model import LeaseSpec, new_lease_token
from qosd.server import start
from qosd.store.redis import RedisStore
from qosd.testing import RedisCluster, RedisServer, redis_server
from qosd_client import LatencySample, QosdClient
from tests.conftest import BASE_CONFIG, merge


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
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._client.ping()
        self._thread.join(5)
        self._client.close()


async def test_uncontended_acquire_is_one_round_trip(own_redis: RedisServer) -> None:
    config = merge(BASE_CONFIG, {"redis": {"url": own_redis.url, "key_prefix": "rt"}})
    daemon = await start(Config.model_validate(config))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            await qos.acquire("P1", 10)  # connections open, scripts known
            with Monitor(own_redis.url) as monitor:
                await asyncio.sleep(0.2)
                result = await qos.acquire("P1", 10, request_id="one-trip")
                await asyncio.sleep(0.2)
            released = await qos.release(result.lease_id)
        assert result.admitted and not released.already_released
        # Only the daemon talks to this server, apart from the monitor's own handshakes.
        sent = [c for c in monitor.commands if not c.startswith(("PING", "MONITOR", "HELLO"))]
        print(f"\ncommands seen for one Acquire: {[c[:60] for c in sent]}")
        assert len(sent) == 1
        assert sent[0].startswith("EVALSHA")
    finally:
        await daemon.stop(0)


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
    finally:
        await daemon.stop(0)
    keys = keys_with_prefix(settings["url"], settings["key_prefix"], backend.name == "cluster")
    by_pool: dict[str, set[int]] = {}
    for key in keys:
        pool = key.split("{", 1)[1].split("}", 1)[0]
        by_pool.setdefault(pool, set()).add(key_slot(key.encode()))
    kinds = sorted({key.split("}:", 1)[1].split(":", 1)[0] for key in keys})
    print(f"\n{len(keys)} keys, kinds {kinds}, slots per pool {by_pool}")
    assert kinds == ["bucket", "leases", "req", "window"]
    assert set(by_pool) == {"alpha", "beta"}
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
        url=redis_cluster3.url, mode=RedisMode.CLUSTER, key_prefix=f"t{uuid.uuid4().hex[:12]}"
    )
    store = RedisStore(config, tombstone_ms=60_000)
    await store.start()
    yield store
    await store.close()


def lease_spec(pool: str, qos_class: str) -> LeaseSpec:
    return LeaseSpec(
        lease_id=f"{pool}:{qos_class}:{new_lease_token()}",
        request_id="",
        tenant="",
        input_tokens=100,
        output_tokens=0,
        weight=1.0,
        ttl_ms=60_000,
    )


async def test_cluster_follows_moved_redirects(cluster_store: RedisStore) -> None:
    policy = resolve_policies(Config.model_validate(BASE_CONFIG))[("default", "P1")]
    assert (await cluster_store.acquire(policy, 100, lease_spec("default", "P1"))).admitted
    client = cluster_store._client
    slot = key_slot(f"{cluster_store._prefix('default')}bucket:P1".encode())
    owner = client._slot_owner[slot]
    wrong = next(node for node in client.nodes() if node is not owner)
    client._slot_owner[slot] = wrong
    decision = await cluster_store.acquire(policy, 100, lease_spec("default", "P1"))
    assert decision.admitted
    assert decision.remaining == pytest.approx(1500 - 200, abs=30)  # the same bucket
    assert client._slot_owner[slot] is owner


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_admission_of_a_departed_caller_is_undone(backend: Any) -> None:
    config = Config.model_validate(merge(BASE_CONFIG, {"redis": backend.redis}))
    store = RedisStore(config.redis, tombstone_ms=60_000)
    await store.start()
    try:
        policy = resolve_policies(config)[("default", "P1")]
        spec = lease_spec("default", "P1")
        call = asyncio.create_task(store.acquire(policy, 1000, spec))
        await asyncio.sleep(0)  # queued in the batcher; the script will admit it
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(50):
            await asyncio.sleep(0.02)
            if await store.active_leases("default") == 0:
                break
        assert await store.active_leases("default") == 0
        assert await store.bucket_tokens(policy) == pytest.approx(1500)  # refunded in full
        # And it really had been admitted: the lease exists, settled as cancelled (3).
        token = spec.lease_id.rpartition(":")[2]
        lease_hash = f"{config.redis.key_prefix}:{{default}}:leases:{token[:8]}"
        url = str(config.redis.url)
        client: Any = (
            redis.cluster.RedisCluster.from_url(url)
            if backend.name == "cluster"
            else redis.Redis.from_url(url)
        )
        settled = client.hget(lease_hash, token).decode()
        client.close()
        assert settled == "R|0|-1000|3"  # final charge 0, adjustment -1000, cancelled
    finally:
        await store.close()
