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

from qosd.config import Config, ConfigError, load_config
from qosd.server import Daemon, start
from qosd.testing import RedisSentinel, free_port, redis_command, redis_sentinel
from qosd_client import QosdClient, Reason
from tests.conftest import BASE_CONFIG, merge
from tests.test_redis_store import Monitor
from tests.waiting import until

# P1 refills at 30 tokens/s from a 300-token burst: at 10 tokens an Acquire, a bucket
# restored from scratch by a failover would admit 30 more than the budget allows.
RATE = 30.0
BURST = 300.0
COST = 10


@pytest.fixture
def sentinel_group() -> Iterator[RedisSentinel]:
    with redis_sentinel() as group:
        yield group


def sentinel_config(group: RedisSentinel, **redis: Any) -> dict[str, Any]:
    return merge(
        BASE_CONFIG,
        {
            "redis": {
                # The host is not used in sentinel mode: the sentinels name the master.
                "url": "redis://sentinel-named-master/0",
                "mode": "sentinel",
                # The first sentinel is down: the next one is asked.
                "sentinels": [f"127.0.0.1:{free_port()}", *group.sentinel_addresses],
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
async def daemon(sentinel_group: RedisSentinel) -> AsyncIterator[Daemon]:
    running = await start(Config.model_validate(sentinel_config(sentinel_group)))
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
    sentinel_group: RedisSentinel,
) -> None:
    # No periodic check, so that only the Acquire's own commands reach the master.
    config = sentinel_config(sentinel_group, sentinel_check_interval_ms=0)
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
