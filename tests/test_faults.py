"""Faults as code (docs/reliability.md): what must keep holding when inputs are hostile,
keys pile up, a Redis Cluster primary dies, or a daemon is killed with waiters queued.
Each test measures what it checks and prints it; the figures in docs/reliability.md
come from these runs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from qosd.config import Config
from qosd.server import start
from qosd.testing import RedisServer, free_port
from qosd.v1 import envoy_rls_pb2 as rls
from qosd.v1 import qosd_pb2 as pb
from qosd_client import QosdClient
from tests.conftest import BASE_CONFIG, merge
from tests.fuzz import mutated, random_message
from tests.waiting import eventually

# -- hostile input ------------------------------------------------------------------

METHODS: list[tuple[str, type[Any], type[Any]]] = [
    ("/qosd.v1.QoS/Acquire", pb.AcquireRequest, pb.AcquireResponse),
    ("/qosd.v1.QoS/Release", pb.ReleaseRequest, pb.ReleaseResponse),
    ("/qosd.v1.QoS/Report", pb.ReportRequest, pb.ReportResponse),
    ("/qosd.v1.Admin/GetStatus", pb.GetStatusRequest, pb.GetStatusResponse),
    ("/qosd.v1.Admin/PinRate", pb.PinRateRequest, pb.PinRateResponse),
    ("/qosd.v1.Admin/UnpinRate", pb.UnpinRateRequest, pb.PinRateResponse),
    ("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
     rls.RateLimitRequest, rls.RateLimitResponse),
    ("/qosd.v1.envoy_rls.RateLimitService/ShouldRateLimit",
     rls.RateLimitRequest, rls.RateLimitResponse),
]  # fmt: skip
# What hostile input may get: an answer, or a status that names what is wrong. Never
# INTERNAL or UNKNOWN (a bug), never a hang (DEADLINE_EXCEEDED at the client's 10 s).
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALLS = 3_000
# Valid requests, for the half of the calls that mutate one to three of their fields.
TEMPLATES: dict[str, Any] = {
    "Acquire": pb.AcquireRequest(
        qos_class="P1", model="llama-3-8b", input_tokens=100, expected_output_tokens=20,
        tenant="t1", request_id="r1", max_wait_ms=50,
    ),
    "Release": pb.ReleaseRequest(
        lease_id="default:P1:0000000100000000000000000000001",
        actual_input_tokens=100, actual_output_tokens=20,
    ),
    "Report": pb.ReportRequest(
        samples=[pb.LatencySample(model="llama-3-8b", qos_class="P1", ttft_ms=80, tpot_ms=20,
                                  e2e_ms=500, input_tokens=100, output_tokens=20)],
        loads=[pb.ServerLoad(model="llama-3-8b", server="gpu-0", waiting_requests=3,
                             kv_cache_usage=0.5)],
    ),
    "GetStatus": pb.GetStatusRequest(pool="default", history=4),
    "PinRate": pb.PinRateRequest(pool="default", rate_tokens_s=5_000_000),
    "UnpinRate": pb.UnpinRateRequest(pool="default"),
    "ShouldRateLimit": rls.RateLimitRequest(
        domain="qosd", hits_addend=1,
        descriptors=[rls.RateLimitDescriptor(entries=[
            rls.RateLimitDescriptor.Entry(key="qos_class", value="P1"),
            rls.RateLimitDescriptor.Entry(key="tokens", value="40"),
        ])],
    ),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["embedded", "redis"], indirect=True)
async def test_random_and_extreme_inputs_get_an_answer_or_a_clear_status(
    make_daemon: Any,
) -> None:
    """Seeded random messages, with edge values in every field, at all 8 methods (the
    control calls on the admin socket, where they are served): each gets an answer
    or a client-side status, with a message; none INTERNAL, UNKNOWN or a hang; and
    the daemon serves a plain Acquire afterwards."""
    running = await make_daemon({"pools": {"default": {"capacity_tokens_s": 10_000_000}}})
    rng = random.Random(13)
    codes: collections.Counter[tuple[str, str]] = collections.Counter()
    bad: list[str] = []
    async with (
        grpc.aio.insecure_channel(running.address) as shared,
        grpc.aio.insecure_channel(running.admin_address) as admin,
    ):
        limit = asyncio.Semaphore(32)
        leases: list[str] = []

        async def one(index: int) -> None:
            path, request_type, response_type = METHODS[index % len(METHODS)]
            method = path.rsplit("/", 1)[1]
            template = TEMPLATES[method]
            if method == "Release" and leases:  # a real lease, so that some settle
                template = pb.ReleaseRequest(
                    lease_id=rng.choice(leases), actual_input_tokens=90, actual_output_tokens=5
                )
            if index % 2:
                request = random_message(request_type, rng)
            elif method == "Release" and index % 4 == 0:
                request = template  # as it is: a real settlement
            else:
                request = mutated(template, rng)
            channel = admin if "/qosd.v1.Admin/" in path else shared
            call = channel.unary_unary(
                path,
                request_serializer=request_type.SerializeToString,
                response_deserializer=response_type.FromString,
            )
            async with limit:
                try:
                    response = await call(request, timeout=10)
                    code = grpc.StatusCode.OK
                    if method == "Acquire" and response.lease_id:
                        leases.append(response.lease_id)
                except grpc.aio.AioRpcError as error:
                    code = error.code()
                    if code in ALLOWED and not error.details():
                        bad.append(f"{path}: {code.name} with no message")
            codes[(path.rsplit("/", 1)[1], code.name)] += 1
            if code not in ALLOWED:
                bad.append(f"{path}: {code.name} for {request!r:.300}")

        await asyncio.gather(*(one(index) for index in range(CALLS)))
    print(f"\n{CALLS} calls: " + ", ".join(f"{m} {c}: {n}" for (m, c), n in sorted(codes.items())))
    assert not bad, "\n".join(bad[:10])
    assert sum(codes.values()) == CALLS
    assert (await running.client.acquire("P0", 10, max_wait_ms=0)).admitted


# -- keys that pile up -----------------------------------------------------------------


async def test_keys_of_many_tenants_and_request_ids_expire(redis_standalone: RedisServer) -> None:
    """10,000 Acquires, each with its own tenant (under a per-tenant ceiling) and
    request id, then releases: once the leases' TTL and tombstones have passed, the
    pool is down to its fixed keys (state, queues, waiters, daemons, control)."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    config = merge(
        BASE_CONFIG,
        {
            "redis": {"url": redis_standalone.url, "key_prefix": prefix},
            "lease": {"ttl_s": 10, "tombstone_s": 1},
            "classes": {"P1": {"tenant_max_share": 0.5}},
            "pools": {"default": {"capacity_tokens_s": 10_000_000}},
        },
    )
    daemon = await start(Config.model_validate(config))
    client = QosdClient(daemon.addresses[0])
    keys = redis.Redis.from_url(redis_standalone.url)

    def pool_keys() -> int:
        return sum(1 for _ in keys.scan_iter(match=f"{prefix}:*", count=1_000))

    try:
        limit = asyncio.Semaphore(64)

        reasons: collections.Counter[str] = collections.Counter()

        async def one(index: int) -> None:
            async with limit:
                result = await client.acquire(
                    "P1", 10, tenant=f"tenant-{index}", request_id=f"req-{index}", max_wait_ms=0
                )
                reasons[result.reason.name] += 1
                if result.admitted and index % 2:  # half released, half left to expire
                    await client.release(result.lease_id, input_tokens=10)

        await asyncio.gather(*(one(index) for index in range(10_000)))
        admitted = reasons["NONE"]
        peak = await asyncio.to_thread(pool_keys)
        left = await eventually(
            lambda: asyncio.to_thread(pool_keys), lambda count: count <= 8, timeout_s=90
        )
        print(f"\n{dict(reasons)}; {peak} keys at the peak, {left} left after expiry")
        assert admitted == 10_000, reasons
        assert peak > 10_000  # the tenants' buckets and request ids were there
        assert left <= 8
    finally:
        keys.close()
        await client.close()
        await daemon.stop(0)


# -- a Redis Cluster primary dies ---------------------------------------------------------


@contextlib.contextmanager
def cluster_with_replicas(directory: Path) -> Iterator[list[RedisServer]]:
    """3 primaries and 3 replicas, a node timeout of 1 s: a dead primary's replica is
    promoted by the cluster itself, as in production."""
    nodes: list[RedisServer] = []
    try:
        for index in range(6):
            node_dir = directory / f"node{index}"
            flags = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-port", str(free_port()),
                "--cluster-node-timeout", "1000",
            )  # fmt: skip
            nodes.append(RedisServer(free_port(), node_dir, flags).start())
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli ships with redis-server"
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{node.port}" for node in nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(node) and _slots_served(node) for node in nodes):
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.kill()


def _command(node: RedisServer, *args: str) -> Any:
    with contextlib.closing(
        redis.Redis(port=node.port, socket_timeout=1, decode_responses=True)
    ) as client:
        return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _cluster_ok(node: RedisServer) -> bool:
    return "cluster_state:ok" in _command(node, "CLUSTER", "INFO")


def _slots_served(node: RedisServer) -> bool:
    """Every slot range has its primary and a replica that has synced."""
    ranges = _command(node, "CLUSTER", "SLOTS")
    return len(ranges) == 3 and all(len(entry) >= 4 for entry in ranges)


def _primary_of(nodes: list[RedisServer], key: str) -> tuple[RedisServer, RedisServer]:
    """The primary serving ``key``'s slot, and its replica."""
    slot = int(_command(nodes[0], "CLUSTER", "KEYSLOT", key))
    for start_slot, end_slot, primary, replica, *_ in _command(nodes[0], "CLUSTER", "SLOTS"):
        if start_slot <= slot <= end_slot:
            by_port = {node.port: node for node in nodes}
            return by_port[int(primary[1])], by_port[int(replica[1])]
    raise AssertionError(f"no node serves slot {slot}")


def _is_primary(node: RedisServer) -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(_command(node, "ROLE")[0] == "master")
    return False


async def test_a_cluster_primary_killed_fails_over_without_a_restart(tmp_path: Path) -> None:
    """SIGKILL the primary that holds the pool: the cluster promotes its replica, and the
    daemon follows (MOVED, then a topology refresh) with no restart. Until then it
    answers by the fail mode, fast; nothing is admitted beyond the rate."""
    with cluster_with_replicas(tmp_path) as nodes:
        config = merge(
            BASE_CONFIG,
            {"redis": {"url": nodes[0].url, "mode": "cluster", "key_prefix": "faults",
                       "cluster_seeds": [f"127.0.0.1:{node.port}" for node in nodes[1:]]}},
        )  # fmt: skip
        primary, replica = _primary_of(nodes, "{default}")
        daemon = await start(Config.model_validate(config))
        client = QosdClient(daemon.addresses[0])
        answers: list[tuple[float, float, bool, str]] = []  # (at, took, admitted, reason)
        began = time.monotonic()
        stop = asyncio.Event()

        async def caller() -> None:
            while not stop.is_set():
                at = time.monotonic()
                result = await client.acquire("P1", 100, max_wait_ms=0, timeout_s=5)
                answers.append((at - began, time.monotonic() - at, result.admitted,
                                result.reason.name))  # fmt: skip
                if not result.admitted:
                    await asyncio.sleep(0.005)  # paced while refused: an open loop's retry

        try:
            callers = [asyncio.create_task(caller()) for _ in range(4)]
            await eventually(lambda: asyncio.sleep(0, len(answers)), lambda n: n > 50)
            killed_at = time.monotonic() - began
            primary.kill()
            promoted = await eventually(
                lambda: asyncio.to_thread(_is_primary, replica), bool, timeout_s=30
            )
            promoted_at = time.monotonic() - began
            assert promoted
            resumed = await eventually(
                lambda: asyncio.sleep(0, [a for a in answers if a[0] > promoted_at and a[2]]),
                bool,
                timeout_s=15,
            )
            await asyncio.sleep(0.5)  # measure: half a second of service after the resumption
            stop.set()
            await asyncio.gather(*callers)
        finally:
            await client.close()
            await daemon.stop(0)
        resumed_at = resumed[0][0]
        took = time.monotonic() - began
        during = [a for a in answers if killed_at < a[0] < resumed_at]
        admitted = sum(100 for a in answers if a[2])
        slowest = max(a[1] for a in answers)
        print(
            f"\npromoted {promoted_at - killed_at:.2f} s after the kill; first admission "
            f"{resumed_at - promoted_at:.2f} s after the promotion; slowest answer "
            f"{slowest * 1000:.0f} ms; during the outage "
            f"{collections.Counter(a[3] for a in during)}; admitted {admitted} tokens in "
            f"{took:.1f} s (P1: 3,000/s, burst 1,500)"
        )
        assert resumed_at - promoted_at < 5.0
        assert all(reason == "BACKEND_UNAVAILABLE" for *_, reason in during if reason != "NONE")
        assert slowest < 1.0  # answered by the store timeout, never hung
        # Replication is asynchronous: the writes of the last moment before the kill may
        # be lost, which can hand back at most a burst.
        assert admitted <= 3_000 * took + 2 * 1_500
