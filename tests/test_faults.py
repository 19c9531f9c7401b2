"""Faults as code (docs/reliability.md): what must keep holding when inputs are hostile,
keys pile up, a Redis Cluster primary dies, or a daemon is killed with waiters queued.
Each test measures what it checks and prints it; the figures in docs/reliability.md
come from these runs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qosd.config import Config
from qosd.server import start
from qosd.v1 import envoy_rls_pb2 as rls
from qosd_client import QosdClient
from qosd_client.v1 import qosd_pb2 as pb
from qosd_harness import DaemonProcess, RedisServer, daemon_processes
from tests.conftest import BASE_CONFIG, TEST_REDIS_TIMEOUT_MS, merge
from tests.fuzz import messages, mutations
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
    grpc.StatusCode.ALREADY_EXISTS,  # a request id that names another request
}
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


EXAMPLES_PER_METHOD = 400


@pytest.fixture(params=["embedded", "redis"])
def fuzzed_daemon(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[DaemonProcess, str]]:
    """``qosd serve`` (a process of its own, so its memory can be read), with an admin
    socket for the control calls."""
    admin = f"{tmp_path}/admin.sock"
    config = merge(
        BASE_CONFIG,
        {
            # listen: BASE_CONFIG's port 0; the ready file says which port it got.
            "server": {"admin_listen": [f"unix:{admin}"]},
            "pools": {"default": {"capacity_tokens_s": 10_000_000}},
        },
    )
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_standalone")
        config["redis"] = {"url": server.url, "key_prefix": f"t{uuid.uuid4().hex[:12]}"}
    daemon = DaemonProcess(config, tmp_path / "daemon").start()
    try:
        yield daemon, f"unix:{admin}"
    finally:
        daemon.kill()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_random_and_extreme_inputs_get_an_answer_or_a_clear_status(
    fuzzed_daemon: tuple[DaemonProcess, str],
) -> None:
    """Hypothesis drives all 8 methods (the control calls on the admin socket, where
    they are served) with random messages and with valid ones whose fields it
    replaces: each call gets an answer or a client-side status with a message; none
    gets INTERNAL, UNKNOWN or no answer in 10 s; the daemon's memory stays flat; and it
    serves a plain Acquire afterwards. Derandomized: the same cases every run."""
    daemon, admin_address = fuzzed_daemon
    assert daemon.process is not None
    codes: collections.Counter[tuple[str, str]] = collections.Counter()
    leases: list[str] = []
    with (
        grpc.insecure_channel(daemon.address) as shared,
        grpc.insecure_channel(admin_address) as admin,
    ):

        def fuzz(path: str, request_type: type[Any], response_type: type[Any], count: int) -> None:
            method = path.rsplit("/", 1)[1]
            call = (admin if "/qosd.v1.Admin/" in path else shared).unary_unary(
                path,
                request_serializer=request_type.SerializeToString,
                response_deserializer=response_type.FromString,
            )
            valid = mutations(TEMPLATES[method])
            if method == "Release":  # a real lease, so that some settle
                valid = valid | st.sampled_from(leases or ["default:P1:0"]).map(
                    lambda lease_id: pb.ReleaseRequest(lease_id=lease_id, actual_input_tokens=90)
                )

            @settings(max_examples=count, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(messages(request_type) | valid)
            def one(request: Any) -> None:
                try:
                    response = call(request, timeout=10)
                    code = grpc.StatusCode.OK
                    if method == "Acquire" and response.lease_id:
                        leases.append(response.lease_id)
                except grpc.RpcError as error:
                    code = error.code()
                    assert code in ALLOWED, f"{path}: {code.name} {error.details()}"
                    assert error.details(), f"{path}: {code.name} with no message"
                codes[(method, code.name)] += 1

            one()

        for path, request_type, response_type in METHODS:  # warm-up: caches, connections
            fuzz(path, request_type, response_type, 30)
        before = rss_bytes(daemon.process.pid)
        for path, request_type, response_type in METHODS:
            fuzz(path, request_type, response_type, EXAMPLES_PER_METHOD)
        after = rss_bytes(daemon.process.pid)
    calls = sum(codes.values())
    print(
        f"\n{calls} calls; RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB; "
        + ", ".join(f"{m} {c}: {n}" for (m, c), n in sorted(codes.items()))
    )
    assert calls >= len(METHODS) * EXAMPLES_PER_METHOD
    assert after - before < 20 * 2**20  # flat: no growth with the number of calls
    with grpc.insecure_channel(daemon.address) as channel:
        answer = pb.AcquireResponse.FromString(
            channel.unary_unary("/qosd.v1.QoS/Acquire")(
                pb.AcquireRequest(
                    qos_class="P0", input_tokens=10, max_wait_ms=0
                ).SerializeToString()
            )
        )
    assert answer.decision == pb.DECISION_ADMITTED


# -- keys that pile up -----------------------------------------------------------------


async def test_keys_of_many_tenants_and_request_ids_expire(redis_standalone: RedisServer) -> None:
    """4,000 Acquires, each with its own tenant (under a per-tenant ceiling) and
    request id, then releases: every tenant bucket and request-id key is written and
    then expires (Redis's own expired events, counted by kind), and once the leases'
    TTL and tombstones have passed, the pool is down to its fixed keys (state, queues,
    waiters, daemons, control). Counting expiries rather than keys at one moment holds
    on a slow machine too: there the first keys expire before the last are written."""
    requests = 4_000
    prefix = f"t{uuid.uuid4().hex[:12]}"
    config = merge(
        BASE_CONFIG,
        {
            "redis": {
                "url": redis_standalone.url,
                "key_prefix": prefix,
                "timeout_ms": TEST_REDIS_TIMEOUT_MS,
            },
            "lease": {"ttl_s": 5, "tombstone_s": 1},
            "classes": {"P1": {"tenant_max_share": 0.5}},
            "pools": {"default": {"capacity_tokens_s": 10_000_000}},
        },
    )
    keys = redis.Redis.from_url(redis_standalone.url)
    expired: collections.Counter[str] = collections.Counter()

    def on_expired(message: dict[str, Any]) -> None:
        name = message["data"].decode()
        if name.startswith(f"{prefix}:"):
            kind = name.split(":")[2]  # prefix:{pool}:kind:...
            expired[kind] += 1

    previous_events = str(keys.config_get("notify-keyspace-events")["notify-keyspace-events"])
    keys.config_set("notify-keyspace-events", "Ex")
    subscriber = keys.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
    subscriber.psubscribe(**{"__keyevent@*__:expired": on_expired})
    listener = subscriber.run_in_thread(sleep_time=0.05, daemon=True)
    daemon = await start(Config.model_validate(config))
    client = QosdClient(daemon.addresses[0])

    def pool_keys() -> collections.Counter[str]:
        """The pool's keys, by kind (prefix:{pool}:kind:...)."""
        found = keys.scan_iter(match=f"{prefix}:*", count=1_000)
        return collections.Counter(name.decode().split(":")[2] for name in found)

    try:
        limit = asyncio.Semaphore(64)

        reasons: collections.Counter[str] = collections.Counter()

        async def one(index: int) -> None:
            async with limit:
                # The client's deadline is not the subject, and 64 calls at once on a busy
                # machine (the daemon on this test's own event loop) can take more than
                # the 1 s an Acquire with no wait gets by default: 30 s.
                result = await client.acquire(
                    "P1", 10, tenant=f"tenant-{index}", request_id=f"req-{index}", max_wait_ms=0,
                    timeout_s=30,
                )  # fmt: skip
                reasons[result.reason.name] += 1
                if result.admitted and index % 2:  # half released, half left to expire
                    await client.release(result.lease_id, input_tokens=10, timeout_s=30)

        await asyncio.gather(*(one(index) for index in range(requests)))
        left = await eventually(
            lambda: asyncio.to_thread(pool_keys),
            lambda kinds: not kinds.keys() & {"tenant", "req", "leases"},
            timeout_s=90,
        )
        # The events of the last keys removed may still be on their way.
        await eventually(
            lambda: asyncio.sleep(0, dict(expired)),
            lambda seen: seen.get("tenant", 0) >= requests and seen.get("req", 0) >= requests,
            timeout_s=10,
        )
        print(f"\n{dict(reasons)}; expired: {dict(expired)}; left: {dict(left)}")
        assert reasons["NONE"] == requests, reasons
        assert expired["tenant"] == requests  # every tenant's bucket was written, then expired
        assert expired["req"] == requests  # and every request id
        assert expired["leases"] >= 1  # the lease hashes, tombstones and all
        # What is left is the fixed keys: the pool's state, queues, waiters and daemons,
        # and the SLO loop's leader lease and records.
        fixed = {"state", "queue", "waiters", "daemons", "leader", "control", "history"}
        assert set(left) <= fixed, left
        assert sum(left.values()) <= 8, left
    finally:
        listener.stop()  # the thread closes its subscriber on the way out
        listener.join(timeout=10)
        keys.config_set("notify-keyspace-events", previous_events)
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
                "--cluster-node-timeout", "1000",
                # Replicas sync at once, not after 5 s, and are counted as synced (in
                # CLUSTER SLOTS) within 1 s: a replica's offset moves with the
                # primary's pings, 10 s apart by default on an idle cluster.
                "--repl-diskless-sync-delay", "0",
                "--repl-ping-replica-period", "1",
            )  # fmt: skip
            # Port 0: the harness reserves the node's port and its bus port.
            node = RedisServer(0, node_dir, flags, cluster_bus=True)
            nodes.append(node)
            node.start()
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
            node.close()


def _command(node: RedisServer, *args: str) -> Any:
    with contextlib.closing(
        redis.Redis(port=node.port, socket_timeout=10, decode_responses=True)
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


# -- a daemon killed mid-lease ------------------------------------------------------------


def test_a_daemon_killed_mid_lease_gives_its_room_back_within_the_lease_ttl(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    """A GPU-gated pool (two batch slots): daemon A takes both and is SIGKILLed, so it
    never releases them. Daemon B's request waits, and is admitted once A's leases
    end by their TTL (2 s), at the latest one second later (leases end by the
    second of Redis time their expiry falls in)."""
    ttl_s = 2.0
    config = merge(
        BASE_CONFIG,
        {
            "redis": {"url": redis_standalone.url, "key_prefix": f"t{uuid.uuid4().hex[:12]}"},
            "pools": {"default": {"max_in_flight": 2, "top_reserve": 0}},
            "lease": {"ttl_s": ttl_s},
            "classes": {"P1": {"max_wait_ms": 10_000}},
        },
    )

    async def scenario(a_address: str, b_address: str, kill_a: Any) -> tuple[float, Any]:
        async with QosdClient(a_address) as a, QosdClient(b_address) as b:
            for _ in range(2):
                assert (await a.acquire("P1", 10, max_wait_ms=0)).admitted
            refused = await b.acquire("P1", 10, max_wait_ms=0)
            assert not refused.admitted  # the room is full
            kill_a()
            killed = time.monotonic()
            result = await b.acquire("P1", 10, max_wait_ms=10_000)
            return time.monotonic() - killed, result

    with daemon_processes(config, count=2) as (daemon_a, daemon_b):
        took, result = asyncio.run(scenario(daemon_a.address, daemon_b.address, daemon_a.kill))
    print(f"\nB admitted={result.admitted} {took:.2f} s after A was killed (lease TTL {ttl_s} s)")
    assert result.admitted
    assert took <= ttl_s + 1.5
