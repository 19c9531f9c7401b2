"""Redis Sentinel: a daemon finds the master through the sentinels (the first that
answers), admits on it in one round trip, follows a failover without a restart and
admits no more than the budget across it; bad sentinel settings name the field."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from qosd.config import Config, ConfigError, RedisConfig, RedisMode, RedisTlsConfig, load_config
from qosd.model import StoreUnavailable
from qosd.server import Daemon, start
from qosd.store.redis_client import ClientOptions
from qosd.store.sentinel import SentinelTransport
from qosd_client import QosdClient, Reason
from qosd_harness import RedisSentinel, closed_port, redis_command, redis_sentinel
from tests.conftest import BASE_CONFIG, merge
from tests.test_redis_store import Monitor
from tests.waiting import eventually, until

# P1 refills at 30 tokens/s from a 300-token burst: at 10 tokens an Acquire, a bucket
# restored from scratch by a failover would admit 30 more than the budget allows.
RATE = 30.0
BURST = 300.0
COST = 10


@pytest.fixture
def sentinel_group() -> Iterator[RedisSentinel]:
    with redis_sentinel() as group:
        yield group


@pytest.fixture(scope="module")
def dead_sentinel() -> Iterator[int]:
    """A sentinel's port that refuses connections: held closed while the module runs,
    so that no other test worker's server can take it and answer."""
    with closed_port() as port:
        yield port


def sentinel_config(
    group: RedisSentinel, dead_sentinel: int | None = None, **redis: Any
) -> dict[str, Any]:
    """The daemon's config on ``group``; with ``dead_sentinel``, a down sentinel first
    in the list (the next one is asked)."""
    down = [] if dead_sentinel is None else [f"127.0.0.1:{dead_sentinel}"]
    return merge(
        BASE_CONFIG,
        {
            "redis": {
                # The host is not used in sentinel mode: the sentinels name the master.
                "url": "redis://sentinel-named-master/0",
                "mode": "sentinel",
                "sentinels": [*down, *group.sentinel_addresses],
                "sentinel_master": group.name,
                "key_prefix": f"s{uuid.uuid4().hex[:10]}",
                "timeout_ms": 1_000,
                "retry_interval_ms": 100,
                **redis,
            },
            "control": {"enabled": False},
            "pools": {"default": {"capacity_tokens_s": RATE / 0.3}},
            "classes": {"P1": {"burst_tokens": BURST}},
        },
    )


@pytest.fixture
async def daemon(sentinel_group: RedisSentinel, dead_sentinel: int) -> AsyncIterator[Daemon]:
    running = await start(Config.model_validate(sentinel_config(sentinel_group, dead_sentinel)))
    yield running
    await running.stop(0)


def commandstats(port: int) -> dict[str, int]:
    info = str(redis_command(port, "INFO", "commandstats"))
    calls: dict[str, int] = {}
    for line in info.splitlines():
        if line.startswith("cmdstat_"):
            name, _, stats = line.removeprefix("cmdstat_").partition(":")
            calls[name] = int(stats.split(",")[0].removeprefix("calls="))
    return calls


async def test_a_sentinel_daemon_admits_and_releases_in_one_round_trip(
    sentinel_group: RedisSentinel, dead_sentinel: int
) -> None:
    # No periodic check, so that only the Acquire's own commands reach the master.
    config = sentinel_config(sentinel_group, dead_sentinel, sentinel_check_interval_ms=0)
    running = await start(Config.model_validate(config))
    assert sentinel_group.master is not None
    try:
        async with QosdClient(running.addresses[0]) as qos:
            first = await qos.acquire("P1", COST, max_wait_ms=0)  # master found, scripts known
            assert first.admitted, first
            with Monitor(sentinel_group.master.url) as monitor:
                answer = await qos.acquire("P1", COST, max_wait_ms=0)
                # The Release's EVALSHA comes after anything the Acquire sent.
                released = await qos.release(answer.lease_id, input_tokens=COST)
        assert answer.admitted and not released.already_released
        # The sentinel's own PING, INFO and PUBLISH to the master are left out.
        sent = [
            command
            for command in monitor.commands
            if not command.startswith(("PING", "INFO", "PUBLISH", "MONITOR", "HELLO"))
        ]
        print(f"\ncommands an Acquire and a Release sent: {[c[:50] for c in sent]}")
        assert len(sent) == 2 and all(c.startswith("EVALSHA") for c in sent)
    finally:
        await running.stop(0)


@dataclass
class Answers:
    """Every answer of a closed loop of one-at-a-time Acquires, with its time."""

    started: float = field(default_factory=time.monotonic)
    answers: list[tuple[float, bool, Reason]] = field(default_factory=list)

    @property
    def admitted(self) -> int:
        return sum(1 for _, admitted, _ in self.answers if admitted)

    def admitted_after(self, moment: float) -> list[float]:
        return [at for at, admitted, _ in self.answers if admitted and at >= moment]

    def longest_gap(self) -> float:
        """The longest time without an answer from Redis (admitted, or refused for
        budget), that is the outage the daemon's callers saw."""
        served = [self.started] + [
            at for at, _, reason in self.answers if reason is not Reason.BACKEND_UNAVAILABLE
        ]
        return max(later - earlier for earlier, later in itertools.pairwise(served))


async def acquire_loop(address: str, answers: Answers, stop: asyncio.Event) -> None:
    async with QosdClient(address) as qos:
        while not stop.is_set():
            answer = await qos.acquire("P1", COST, max_wait_ms=0)
            answers.answers.append((time.monotonic(), answer.admitted, answer.reason))
            if answer.reason is Reason.BACKEND_UNAVAILABLE:
                await asyncio.sleep(0.01)  # a client's back-off; fail-fast answers are instant


@pytest.mark.parametrize("how", ["sentinel-failover", "master-killed"])
async def test_admission_follows_a_failover_without_over_admitting(
    sentinel_group: RedisSentinel, daemon: Daemon, how: str
) -> None:
    group = sentinel_group
    assert group.master is not None and group.replica is not None
    replica = group.replica
    answers = Answers()
    stop = asyncio.Event()
    loop_task = asyncio.create_task(acquire_loop(daemon.addresses[0], answers, stop))
    try:
        # The burst is spent and the bucket runs on its refill before the failover.
        assert await until(lambda: answers.admitted >= BURST / COST + 3, timeout_s=20)
        failed_over_at = time.monotonic()
        if how == "sentinel-failover":
            await asyncio.to_thread(group.failover)
        else:
            group.master.kill()
            promoted = await until(
                lambda: group.master_port() == replica.port and group.role(replica) == "master",
                timeout_s=30,
            )
            assert promoted, "the sentinel did not promote the replica"
        promoted_at = time.monotonic()
        # The promoted replica runs scripts for the daemon: no restart, no help.
        resumed = await until(
            lambda: commandstats(replica.port).get("evalsha", 0) > 0,
            timeout_s=20,
        )
        assert resumed, "the daemon never sent a script to the promoted replica"
        switched_at = time.monotonic()
        # Admissions go on at the refill rate on the new master.
        assert await until(lambda: len(answers.admitted_after(switched_at)) >= 3, timeout_s=20)
    finally:
        stop.set()
        await loop_task
    ended = time.monotonic()
    first_admission = answers.admitted_after(promoted_at)[0]
    budget = BURST + RATE * (ended - answers.started)
    print(
        f"\n{how}: promoted {promoted_at - failed_over_at:.2f} s after the failover began; "
        f"first admission {first_admission - failed_over_at:.2f} s after it began, "
        f"{first_admission - promoted_at:.2f} s after the promotion; longest time "
        f"without a Redis answer {answers.longest_gap():.2f} s; admitted "
        f"{answers.admitted * COST} tokens of a {budget:.0f}-token budget "
        f"({len(answers.answers)} answers)"
    )
    assert answers.admitted * COST <= budget
    # A restored-from-scratch bucket would have let a whole burst through again.
    assert first_admission - failed_over_at < 20


def test_bad_sentinel_settings_name_the_field() -> None:
    base = {"QOSD_REDIS_URL": "redis://m/0", "QOSD_REDIS_MODE": "sentinel"}
    cases = {
        "redis: sentinels: mode: sentinel needs at least one HOST:PORT": {
            "QOSD_REDIS_SENTINEL_MASTER": "m"
        },
        "redis.sentinels: 'nohost': expected HOST:PORT": {
            "QOSD_REDIS_SENTINELS": "h:26379,nohost",
            "QOSD_REDIS_SENTINEL_MASTER": "m",
        },
        "redis: sentinel_master: mode: sentinel needs the master's name": {
            "QOSD_REDIS_SENTINELS": "h:26379"
        },
        "redis.sentinel_master: must be non-empty, without whitespace": {
            "QOSD_REDIS_SENTINELS": "h:26379",
            "QOSD_REDIS_SENTINEL_MASTER": "my master",
        },
    }
    for message, env in cases.items():
        with pytest.raises(ConfigError) as raised:
            load_config(env={**base, **env})
        assert message in str(raised.value), str(raised.value)
    with pytest.raises(ConfigError, match="redis: sentinels: only with mode: sentinel"):
        load_config(env={"QOSD_REDIS_URL": "redis://m/0", "QOSD_REDIS_SENTINELS": "h:1"})
    with pytest.raises(ConfigError, match="redis: url: mode: sentinel needs redis://"):
        load_config(
            env={**base, "QOSD_REDIS_URL": "unix:///r.sock", "QOSD_REDIS_SENTINELS": "h:1",
                 "QOSD_REDIS_SENTINEL_MASTER": "m"}
        )  # fmt: skip
    config = load_config(
        env={
            **base,
            "QOSD_REDIS_SENTINELS": "h:26379, [::1]:26380",
            "QOSD_REDIS_SENTINEL_MASTER": "mymaster",
            "QOSD_REDIS_SENTINEL_PASSWORD": "sentinel-secret",
            "QOSD_REDIS_USERNAME": "qosd",
        }
    )
    assert config.redis.sentinels == ["h:26379", "[::1]:26380"]
    assert config.redis.sentinel_master == "mymaster"
    assert config.redis.username == "qosd"
    assert config.redis.sentinel_password is not None
    assert "sentinel-secret" not in repr(config.redis)


# A short timeout, so that asking three hung sentinels one after the other (about
# 3 x 400 ms) is plainly longer than what one call may take (one timeout). 400 ms, not
# less: the bound below leaves a whole timeout of margin for a busy machine, and must
# stay below three timeouts to tell the two apart.
SHORT_TIMEOUT_MS = 400


@pytest.mark.parametrize("how", ["killed", "hung"])
async def test_with_every_sentinel_down_a_call_is_answered_within_its_timeout(how: str) -> None:
    with redis_sentinel(sentinels=3) as group:
        for sentinel in group.sentinels:
            sentinel.kill() if how == "killed" else sentinel.pause()
        config = sentinel_config(
            group,
            timeout_ms=SHORT_TIMEOUT_MS,
            # Every Acquire asks the store: none is answered by the guard's fail-fast.
            retry_interval_ms=0,
        )
        config["fail_mode"] = "closed"
        started = time.monotonic()
        running = await start(Config.model_validate(config))
        start_s = time.monotonic() - started
        try:
            async with QosdClient(running.addresses[0]) as qos:
                took: list[float] = []
                for _ in range(3):
                    asked = time.monotonic()
                    # The client's deadline (10 s) is not the subject: the store's is.
                    answer = await qos.acquire("P1", COST, max_wait_ms=0, timeout_s=10)
                    took.append(time.monotonic() - asked)
                    assert answer.reason is Reason.BACKEND_UNAVAILABLE, answer
                # One sentinel back: the discovery that goes on in the background
                # finds the master, with no restart.
                back = group.sentinels[1]
                back.start_sentinel() if how == "killed" else back.resume()
                resumed_at = time.monotonic()
                admitted = await eventually(
                    lambda: qos.acquire("P1", COST, max_wait_ms=0, timeout_s=10),
                    lambda answer: answer.admitted,
                    timeout_s=20,
                )
                assert admitted.admitted, admitted
                resumed_s = time.monotonic() - resumed_at
        finally:
            await running.stop(0)
    print(
        f"\nevery sentinel {how}: start took {start_s:.2f} s; Acquires answered in "
        f"{', '.join(f'{t * 1000:.0f}' for t in took)} ms (timeout {SHORT_TIMEOUT_MS} ms); "
        f"admitted {resumed_s:.2f} s after a sentinel came back"
    )
    # Halfway between one timeout (the right answer, plus the RPC's own time) and
    # three (the sentinels asked one after the other): a whole timeout of margin for
    # a busy machine, and the two still told apart.
    assert max(took) < 2 * SHORT_TIMEOUT_MS / 1000, took
    assert start_s < 5


def sentinel_transport(
    group: RedisSentinel,
    *,
    url: str = "redis://sentinel-named-master/0",
    tls: RedisTlsConfig | None = None,
    sentinel_tls: bool | None = None,
    check_interval_ms: int = 1_000,
) -> SentinelTransport:
    """The store's transport on its own, to watch what it does to the servers."""
    config = RedisConfig(
        url=url,
        mode=RedisMode.SENTINEL,
        sentinels=group.sentinel_addresses,
        sentinel_master=group.name,
        timeout_ms=1_000,
        tls=tls,
        sentinel_tls=sentinel_tls,
        sentinel_check_interval_ms=check_interval_ms,
    )
    return SentinelTransport(ClientOptions.of(config), config)


def client_connections(port: int) -> int:
    """Connections of plain clients to the server on ``port`` (qosd's), leaving out
    sentinels (named ``sentinel-...``), replicas (flag S) and this check's own."""
    clients = str(redis_command(port, "CLIENT", "LIST")).splitlines()
    return sum(
        1
        for line in clients
        if " name= " in f"{line} " and " flags=N " in f" {line} " and "cmd=client|list" not in line
    )


async def test_an_old_master_is_closed_and_never_reopened_after_a_failover(
    sentinel_group: RedisSentinel,
) -> None:
    group = sentinel_group
    assert group.master is not None and group.replica is not None
    old_port = group.master.port
    transport = sentinel_transport(group, check_interval_ms=50)
    try:
        assert await transport.execute("k", "ECHO", "hello") == "hello"
        assert transport.master == ("127.0.0.1", old_port)
        assert client_connections(old_port) > 0
        old = transport._master  # what a NOSCRIPT retry in flight would still hold
        assert old is not None
        new_master = ("127.0.0.1", group.replica.port)
        await asyncio.to_thread(group.failover)
        assert await until(lambda: transport.master == new_master, 20)
        # Its connections go once replies already on their way had time to arrive.
        assert await until(lambda: client_connections(old_port) == 0, 10)
        # A caller that still holds it is told the store is unavailable; no
        # connection to the demoted master is opened for it.
        with pytest.raises(StoreUnavailable, match="retired"):
            await old.execute("PING")
        assert await transport.execute("k", "ECHO", "hello") == "hello"  # the new master
        assert client_connections(old_port) == 0
    finally:
        await transport.close()


def role_probes(port: int) -> int:
    """Connections to the server on ``port`` whose last command was ROLE (qosd's
    check of an address a sentinel named; sentinels themselves send INFO)."""
    clients = str(redis_command(port, "CLIENT", "LIST"))
    return sum(1 for line in clients.splitlines() if " cmd=role " in f" {line} ")


async def test_a_replica_a_sentinel_names_is_closed_and_forgotten() -> None:
    # No failover during the test: the first sentinel names the replica as the master.
    with redis_sentinel(sentinels=2, down_after_ms=60_000) as group:
        assert group.master is not None and group.replica is not None
        wrong = group.sentinels[0].port
        assert redis_command(wrong, "SENTINEL", "REMOVE", group.name) == "OK"
        assert (
            redis_command(
                wrong, "SENTINEL", "MONITOR", group.name, "127.0.0.1", str(group.replica.port), "1"
            )
            == "OK"
        )
        assert group.master_port(0) == group.replica.port
        transport = sentinel_transport(group, check_interval_ms=0)
        try:
            assert await transport.execute("k", "ECHO", "hello") == "hello"
            assert transport.master == ("127.0.0.1", group.master.port)
            # The ROLE probe's connection to the replica is closed, not left open.
            replica_port = group.replica.port
            assert await until(lambda: role_probes(replica_port) == 0, 10)
            assert client_connections(replica_port) == 0
        finally:
            await transport.close()


async def test_sentinels_take_tls_apart_from_the_master(sentinel_group: RedisSentinel) -> None:
    group = sentinel_group
    assert group.master is not None
    # The group is plain. TLS to the master, plain to the sentinels: the sentinels
    # answer and name the master, and only the TLS handshake with the master fails.
    client = sentinel_transport(
        group,
        url="rediss://sentinel-named-master/0",
        tls=RedisTlsConfig(verify=False),
        sentinel_tls=False,
    )
    try:
        with pytest.raises(StoreUnavailable) as raised:
            await client.execute("k", "PING")
        assert f"127.0.0.1:{group.master.port}, named by sentinel" in str(raised.value)
    finally:
        await client.close()
    # Plain master, TLS to the sentinels: no sentinel can be asked.
    client = sentinel_transport(group, tls=RedisTlsConfig(verify=False), sentinel_tls=True)
    try:
        with pytest.raises(StoreUnavailable) as raised:
            await client.execute("k", "PING")
        assert "named by" not in str(raised.value)
        assert f"sentinel 127.0.0.1:{group.sentinels[0].port}:" in str(raised.value)
    finally:
        await client.close()
    # And by default the sentinels follow the URL: plain here, and all works.
    client = sentinel_transport(group)
    try:
        assert await client.execute("k", "ECHO", "hello") == "hello"
    finally:
        await client.close()
