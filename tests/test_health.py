"""Health that means "can answer as configured": gRPC health and the HTTP probes follow
the store under fail-closed, stay SERVING under fail-open, and go NOT_SERVING on drain.

Each test starts its own Redis and kills it on purpose, then restarts it on its port.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qosd.config import Config
from qosd.server import Daemon, StartupError, start
from qosd_harness import RedisServer, closed_port, redis_server
from tests.conftest import BASE_CONFIG, merge
from tests.waiting import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
INTERVAL_S = 0.2


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def _config(extra: dict[str, Any]) -> Config:
    server = {"http_listen": "127.0.0.1:0", "health_check_interval_s": INTERVAL_S}
    return Config.model_validate(merge(BASE_CONFIG, merge({"server": server}, extra)))


def _redis(url: str, fail_mode: str) -> dict[str, Any]:
    return {
        "fail_mode": fail_mode,
        "redis": {
            "url": url,
            "key_prefix": f"t{uuid.uuid4().hex[:12]}",
            "timeout_ms": 100,
            "connect_timeout_ms": 100,
            "retry_interval_ms": 200,
        },
    }


@pytest.fixture
async def running() -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[Daemon]]]:
    started: list[Daemon] = []

    async def factory(extra: dict[str, Any]) -> Daemon:
        daemon = await start(_config(extra))
        started.append(daemon)
        return daemon

    yield factory
    for daemon in started:
        await daemon.stop(0)


async def _grpc_status(daemon: Daemon, service: str = "") -> int:
    async with grpc.aio.insecure_channel(daemon.addresses[0]) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
        return int(reply.status)


async def _http(daemon: Daemon, path: str) -> tuple[int, Any]:
    assert daemon.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{daemon.http.address}{path}") as response,
    ):
        body = await (response.json() if path == "/readyz" else response.text())
        return response.status, body


async def _wait_for(daemon: Daemon, status: int, within_s: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < within_s:
        if await _grpc_status(daemon) == status:
            return time.monotonic() - began
        await asyncio.sleep(0.05)
    raise AssertionError(f"health did not become {status} within {within_s}s")


async def test_probes_on_the_embedded_store(running: Any) -> None:
    daemon = await running({})
    for service in ("", "qosd.v1.QoS", "qosd.v1.Admin"):
        assert await _grpc_status(daemon, service) == SERVING
    assert await _http(daemon, "/healthz") == (200, "ok\n")
    status, body = await _http(daemon, "/readyz")
    assert (status, body["ready"], body["reason"]) == (200, True, "ok")


async def test_fail_closed_is_not_serving_while_redis_is_down(
    running: Any, own_redis: RedisServer
) -> None:
    daemon = await running(_redis(own_redis.url, "closed"))
    assert await _grpc_status(daemon) == SERVING
    own_redis.kill()
    took = await _wait_for(daemon, NOT_SERVING, within_s=10)
    assert took < 1.5  # a check interval (0.2 s) plus the store timeout, and slack
    assert await _grpc_status(daemon, "qosd.v1.QoS") == NOT_SERVING
    status, body = await _http(daemon, "/readyz")
    assert status == 503 and not body["ready"] and "store unreachable" in body["reason"]
    assert (await _http(daemon, "/healthz"))[0] == 200  # alive, only not ready
    own_redis.start()
    await _wait_for(daemon, SERVING, within_s=10)
    assert (await _http(daemon, "/readyz"))[0] == 200


async def test_fail_open_keeps_serving_while_redis_is_down(
    running: Any, own_redis: RedisServer
) -> None:
    daemon = await running(_redis(own_redis.url, "open"))
    own_redis.kill()

    async def serving_and_ready() -> tuple[int, Any]:
        assert await _grpc_status(daemon) == SERVING  # while the monitor notices, too
        return await _http(daemon, "/readyz")

    # The monitor sees the store go (a check interval plus the store timeout) ...
    _, seen = await eventually(serving_and_ready, lambda reply: not reply[1]["store_reachable"], 10)
    assert not seen["store_reachable"]
    for _ in range(8):  # ... and several check intervals later, it still serves
        await asyncio.sleep(INTERVAL_S)
        assert await _grpc_status(daemon) == SERVING
    status, body = await _http(daemon, "/readyz")
    assert status == 200 and not body["store_reachable"]
    assert "fail-open" in body["reason"]


async def test_draining_is_not_serving(running: Any) -> None:
    daemon = await running({})
    await daemon.monitor.stop()  # the first step of Daemon.stop, on SIGTERM
    assert await _grpc_status(daemon) == NOT_SERVING
    status, body = await _http(daemon, "/readyz")
    assert status == 503 and body["reason"] == "draining"
    await daemon.monitor.check()  # a store that answers does not make it ready again
    assert (await _http(daemon, "/readyz"))[0] == 503


async def test_a_busy_http_port_is_a_startup_error(running: Any) -> None:
    first = await running({})
    assert first.http is not None
    with pytest.raises(StartupError, match="cannot listen"):
        await start(_config({"server": {"http_listen": first.http.address}}))
    with closed_port() as port:  # only validated, never bound
        assert _config({"server": {"http_listen": f"127.0.0.1:{port}"}}).server.http_listen
