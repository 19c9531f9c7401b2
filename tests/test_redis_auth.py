"""A Redis that wants a password: given in the URL, or apart from it (as a Kubernetes
Secret provides it, through $QOSD_REDIS_PASSWORD), and never printed. A Redis 6+ ACL
user with only the commands and keys qosd needs, and a wrong password named at start."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from qosd.config import Config, load_config
from qosd.model import Outcome, PrefillLearned, Sample, ServerLoad, UsageReport, Waiter
from qosd.server import start
from qosd.store.redis import RedisStore
from qosd_client import QosdClient, Reason
from qosd_harness import RedisServer, redis_command, redis_server
from tests.conftest import BASE_CONFIG, merge
from tests.test_redis_store import lease_spec, policies

SECRET = "s3cret-for-tests"
DAEMON = "test-daemon"


@pytest.fixture(scope="module")
def guarded_redis() -> Iterator[RedisServer]:
    with redis_server(["--requirepass", SECRET]) as server:
        yield server


@pytest.mark.parametrize("how", ["env", "url"])
async def test_the_password_reaches_redis(guarded_redis: RedisServer, how: str) -> None:
    url = guarded_redis.url
    env = {"QOSD_REDIS_URL": url, "QOSD_LISTEN": "127.0.0.1:0"}
    if how == "env":
        env["QOSD_REDIS_PASSWORD"] = SECRET
    else:
        env["QOSD_REDIS_URL"] = url.replace("redis://", f"redis://:{SECRET}@")
    daemon = await start(load_config(env=env))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            assert (await qos.acquire("P1", 10)).admitted
    finally:
        await daemon.stop(0)


async def test_a_wrong_password_fails_closed(guarded_redis: RedisServer) -> None:
    env = {
        "QOSD_REDIS_URL": guarded_redis.url,
        "QOSD_REDIS_PASSWORD": "wrong",
        "QOSD_LISTEN": "127.0.0.1:0",
    }
    daemon = await start(load_config(env=env))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            answer = await qos.acquire("P1", 10)
        assert not answer.admitted and answer.reason is Reason.BACKEND_UNAVAILABLE
    finally:
        await daemon.stop(0)


def test_config_check_masks_the_password() -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "qosd.cli", "config", "check", "/dev/null"],
        env={"QOSD_REDIS_PASSWORD": SECRET, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert SECRET not in checked.stdout
    assert json.loads(checked.stdout)["redis"]["password"] == "**********"


# The least a Redis 6+ ACL user needs for qosd (docs/security.md, "Redis ACL"): the
# script calls and the few plain commands qosd sends, the commands its scripts call
# (ACLs apply inside scripts too), and its own keys only. Sentinel mode adds +role,
# cluster mode +cluster|slots, a db other than 0 +select.
ACL_USER = "qosd"
ACL_PASSWORD = "acl-pass-for-tests"
ACL_RULE = (
    "resetkeys ~qosd:* resetchannels -@all "
    "+evalsha +script|load +ping +hset +hdel +lrange "
    "+time +get +set +del +pexpire +hget +hmget +hgetall +hkeys +hlen +hexists "
    "+lpush +ltrim +zadd +zcard +zrange +zrem"
)


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        reply = redis_command(
            server.port, "ACL", "SETUSER", ACL_USER, "reset", "on", f">{ACL_PASSWORD}",
            *ACL_RULE.split(),
        )  # fmt: skip
        assert reply == "OK", reply
        yield server


def acl_denials(server: RedisServer) -> list[Any]:
    return list(redis_command(server.port, "ACL", "LOG"))


def acl_log_reset(server: RedisServer) -> None:
    """Forgets the denials of the module's earlier tests (a wrong password's, on
    purpose), in whatever order they ran: a test counts its own."""
    assert redis_command(server.port, "ACL", "LOG", "RESET") == "OK"


@pytest.mark.parametrize("how", ["url", "env"])
async def test_a_daemon_works_as_an_acl_user(acl_redis: RedisServer, how: str) -> None:
    env = {"QOSD_LISTEN": "127.0.0.1:0", "QOSD_REDIS_URL": acl_redis.url}
    if how == "url":
        env["QOSD_REDIS_URL"] = acl_redis.url.replace(
            "redis://", f"redis://{ACL_USER}:{ACL_PASSWORD}@"
        )
    else:
        env |= {"QOSD_REDIS_USERNAME": ACL_USER, "QOSD_REDIS_PASSWORD": ACL_PASSWORD}
    acl_log_reset(acl_redis)
    daemon = await start(load_config(env=env))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            answer = await qos.acquire("P1", 10)
            assert answer.admitted, answer
            assert not (await qos.release(answer.lease_id, input_tokens=10)).already_released
            assert (await qos.status()).pools
    finally:
        await daemon.stop(0)
    assert acl_denials(acl_redis) == []


async def test_every_store_call_runs_under_the_minimal_acl(acl_redis: RedisServer) -> None:
    """Each script and command qosd has, run as the ACL user: none is refused (a
    refused command inside a script fails the call, and ACL LOG would show it)."""
    url = acl_redis.url.replace("redis://", f"redis://{ACL_USER}:{ACL_PASSWORD}@")
    config = Config.model_validate(merge(BASE_CONFIG, {"redis": {"url": url}}))
    acl_log_reset(acl_redis)
    store = RedisStore(config.redis, tombstone_ms=60_000, daemon_id=DAEMON)
    await store.start()
    try:
        pool, p1 = policies(config, "P1")
        await store.ping()
        first = await store.acquire(pool, p1, lease_spec("default", "P1", 1_400), 0)
        assert first.admitted
        queued_spec = lease_spec("default", "P1", 1_400)
        queued = await store.acquire(pool, p1, queued_spec, 5_000)
        assert queued.queued, queued
        waiter = Waiter("P1", 1_400, queued_spec)
        await store.pump(pool, [waiter])
        await store.cancel(pool, [waiter])
        usage = UsageReport(1_400, 10, Outcome.OK)
        await store.release(pool, p1, first.lease_id, usage)
        # A request id (its key checked and written) and an undo (which frees it).
        named = dataclasses.replace(lease_spec("default", "P1", 10), request_id="acl-req")
        assert (await store.acquire(pool, p1, named, 0)).admitted
        assert (await store.acquire(pool, p1, named, 0)).duplicate
        await store.undo(pool, p1, named)
        await store.status(pool)
        record = await store.control(pool)
        await store.adjust(pool, dataclasses.replace(record, capacity=9_000.0), 0, force=True)
        assert (await store.history(pool))[0].changed_to == 9_000.0
        await store.set_prefill(pool, PrefillLearned((1.0, 2.0, 3.0), 500.0, 120.0))
        await store.set_prefill(pool, PrefillLearned(None, None, 0.0))
        await store.report_load(pool, [ServerLoad("server-1", 3, 0.5)])
        assert await store.lead(5_000) == DAEMON
        await store.lead(0)  # resigns
        sample = Sample("default", "P1", "", 100.0, 10.0, 1_000.0, 100, 10, Outcome.OK)
        await store.report([sample], 100)
        assert len(await store.window("default", "P1")) == 1
    finally:
        await store.close()
    assert acl_denials(acl_redis) == []


async def test_a_wrong_acl_password_is_named_at_start(
    acl_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    env = {
        "QOSD_LISTEN": "127.0.0.1:0",
        "QOSD_REDIS_URL": acl_redis.url,
        "QOSD_REDIS_USERNAME": ACL_USER,
        "QOSD_REDIS_PASSWORD": "not-the-password",
    }
    with caplog.at_level(logging.ERROR, logger="qosd.store.redis"):
        daemon = await start(load_config(env=env))
    try:
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(
            "redis refused qosd's credentials" in message
            and "invalid username-password pair" in message
            for message in errors
        ), errors
        async with QosdClient(daemon.addresses[0]) as qos:
            answer = await qos.acquire("P1", 10)
        assert not answer.admitted and answer.reason is Reason.BACKEND_UNAVAILABLE
    finally:
        await daemon.stop(0)
