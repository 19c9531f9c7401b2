"""Shared fixtures: real Redis servers (standalone and a 3-node cluster) started by the
tests themselves, and in-process daemons serving gRPC on real sockets."""

from __future__ import annotations

import os

# The tests fork and exec (the CLI, daemons, simulators) from a process that runs gRPC
# servers and channels. gRPC's fork handlers then run in the child between fork and
# exec, and can deadlock there (grpc/grpc#22624): a make test on a fresh clone hung for
# good in test_fleet_control's CLI test, its child still a copy of pytest. Every child
# here execs at once, which is the case gRPC documents for turning the handlers off. Set
# before gRPC is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import asyncio  # after the environment that gRPC reads at import
import copy
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from qosd.config import Config
from qosd.server import Daemon, start
from qosd_client import QosdClient
from qosd_harness import RedisCluster, RedisServer, redis_cluster, redis_server


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests run on uvloop, the loop the daemon runs on in production."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def redis_standalone() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster3() -> Iterator[RedisCluster]:
    with redis_cluster(3) as cluster:
        yield cluster


@dataclass(frozen=True)
class Backend:
    name: str
    redis: dict[str, Any] | None


BACKENDS = ["embedded", "redis", "cluster"]


# A store deadline for tests whose subject is not an outage: the default 100 ms is
# what a sidecar next to its Redis should wait, and a loaded 2-CPU machine running
# two test files at once can hold a healthy call past it. Tests of timeouts and
# outages set their own.
TEST_REDIS_TIMEOUT_MS = 1_000


def backend_settings(name: str, request: pytest.FixtureRequest) -> dict[str, Any] | None:
    prefix = f"t{uuid.uuid4().hex[:12]}"
    if name == "embedded":
        return None
    if name == "redis":
        server: RedisServer = request.getfixturevalue("redis_standalone")
        return {"url": server.url, "mode": "standalone", "key_prefix": prefix,
                "timeout_ms": TEST_REDIS_TIMEOUT_MS}  # fmt: skip
    cluster: RedisCluster = request.getfixturevalue("redis_cluster3")
    return {"url": cluster.url, "mode": "cluster", "key_prefix": prefix,
            "timeout_ms": TEST_REDIS_TIMEOUT_MS}  # fmt: skip


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    return Backend(request.param, backend_settings(request.param, request))


# Rates are easy to reason about: pool capacity 10,000 tokens/s, so P0 refills at
# 6,000/s (burst 3,000), P1 at 3,000/s (burst 1,500), P2 at 1,000/s (burst 500).
# Borrowing is off: these are the semantics of one class's bucket. Tests of the
# shared pool and the waiting room turn it on (BORROWING).
BASE_CONFIG: dict[str, Any] = {
    "server": {"listen": ["127.0.0.1:0"], "drain_grace_s": 2},
    "pools": {"default": {"capacity_tokens_s": 10_000, "models": ["llama-3-8b"]}},
    "classes": {
        "P0": {"priority": 0, "share": 0.6, "max_wait_ms": 200, "can_borrow": False},
        "P1": {"priority": 1, "share": 0.3, "max_wait_ms": 2_000, "can_borrow": False},
        "P2": {"priority": 2, "share": 0.1, "max_wait_ms": 5_000, "can_borrow": False},
    },
}
BORROWING: dict[str, Any] = {"classes": {name: {"can_borrow": True} for name in ("P0", "P1", "P2")}}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


@dataclass
class RunningDaemon:
    daemon: Daemon
    client: QosdClient
    # On the admin listener (a unix socket), where control calls need no credentials.
    admin: QosdClient

    @property
    def address(self) -> str:
        return self.daemon.addresses[0]

    @property
    def admin_address(self) -> str:
        return self.daemon.admin_addresses[0]


DaemonFactory = Callable[..., Awaitable[RunningDaemon]]


@pytest.fixture
async def make_daemon(backend: Backend) -> AsyncIterator[DaemonFactory]:
    """Starts in-process daemons on the test's backend; extra config merges over BASE."""
    running: list[RunningDaemon] = []

    sockets = tempfile.TemporaryDirectory(prefix="qa")  # short: unix paths are <108 bytes

    async def factory(extra: dict[str, Any] | None = None) -> RunningDaemon:
        admin_socket = f"unix:{sockets.name}/admin{len(running)}.sock"
        tree = merge(merge(BASE_CONFIG, {"server": {"admin_listen": [admin_socket]}}), extra or {})
        if backend.redis is not None:
            tree["redis"] = merge(backend.redis, tree.get("redis", {}))
        daemon = await start(Config.model_validate(tree))
        item = RunningDaemon(
            daemon,
            QosdClient(daemon.addresses[0]),
            QosdClient((daemon.admin_addresses or daemon.addresses)[0]),
        )
        running.append(item)
        return item

    yield factory
    for item in running:
        await item.client.close()
        await item.admin.close()
        await item.daemon.stop(0)
    sockets.cleanup()
