"""A Redis that wants a password: given in the URL, or apart from it (as a Kubernetes
Secret provides it, through $QOSD_REDIS_PASSWORD), and never printed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from qosd.config import load_config
from qosd.server import start
from qosd.testing import RedisServer, redis_server
from qosd_client import QosdClient, Reason

SECRET = "s3cret-for-tests"


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
