"""The daemon as a process and a server: health, reflection, listen addresses,
message limits, drain on SIGTERM, deadlines, cancellation and the sync client."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import qosd_client
from qosd import model
from qosd.config import Config
from qosd.server import StartupError, start
from qosd.store.embedded import EmbeddedStore
from qosd_client import (
    InvalidRequest,
    LatencySample,
    QosdClient,
    QosdError,
    Reason,
    Rejected,
    SyncQosdClient,
    Unavailable,
)
from qosd_client.v1 import qosd_pb2
from qosd_harness import DaemonProcess, closed_port, reserve_port
from tests.conftest import BASE_CONFIG, DaemonFactory, merge
from tests.waiting import eventually


def test_domain_enums_match_the_wire() -> None:
    """Reasons and outcomes cross the wire as plain integers, so the values must agree."""
    for wire, prefix, enums in (
        (qosd_pb2.Reason, "REASON_", (model.Reason, qosd_client.Reason)),
        (qosd_pb2.Outcome, "OUTCOME_", (model.Outcome, qosd_client.Outcome)),
    ):
        for python_enum in enums:
            assert sorted(m.value for m in python_enum) == sorted(wire.values())
            for member in python_enum:
                name = "UNSPECIFIED" if member.name == "NONE" else member.name
                assert wire.Name(member.value) == prefix + name  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_health_and_reflection(make_daemon: DaemonFactory) -> None:
    running = await make_daemon()
    async with grpc.aio.insecure_channel(running.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "qosd.v1.QoS"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in reflection.ServerReflectionInfo(iter([request])):
            names = {service.name for service in reply.list_services_response.service}
        assert {"qosd.v1.QoS", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_unix_socket_and_tcp_together(make_daemon: DaemonFactory) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/sub/qosd.sock"
        running = await make_daemon({"server": {"listen": ["127.0.0.1:0", f"unix:{path}"]}})
        tcp, unix = running.daemon.addresses
        assert tcp.startswith("127.0.0.1:") and tcp != "127.0.0.1:0" and unix == f"unix:{path}"
        # A gateway in another container (another uid, the pod's group) can connect.
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        async with QosdClient(f"unix:{path}") as over_socket:
            assert (await over_socket.acquire("P1", 10)).admitted
        async with QosdClient(tcp) as over_tcp:
            assert (await over_tcp.acquire("P1", 10)).admitted


async def test_port_in_use_stops_start_up() -> None:
    first = await start(Config.model_validate(BASE_CONFIG))  # port 0: the port it got
    (address,) = first.addresses
    config = Config.model_validate(merge(BASE_CONFIG, {"server": {"listen": [address]}}))
    try:
        with pytest.raises(StartupError, match=f"cannot listen on {address}"):
            await start(config)
    finally:
        await first.stop(0)


async def test_a_start_that_fails_late_undoes_what_it_started(tmp_path: Path) -> None:
    """The HTTP port is taken, so start fails after the gRPC port, the admin socket
    and the store were set up: all of them are released (the ports can be bound
    again, the socket file is gone), so a supervisor's retry finds nothing held."""
    # The ports must be the same in both starts (that they can be bound again is the
    # point), so not port 0: they are reserved for the test, so that no other process
    # takes one in between; the daemon binds them through the reservations.
    with reserve_port() as grpc_reserved, reserve_port() as http_reserved:
        grpc_port, http_port = grpc_reserved.port, http_reserved.port
        admin = tmp_path / "admin.sock"
        tree = {"server": {"listen": [f"127.0.0.1:{grpc_port}"], "admin_listen": [f"unix:{admin}"],
                           "http_listen": f"127.0.0.1:{http_port}"}}  # fmt: skip
        with socket.socket() as taken:  # a listener on the HTTP port: the first start fails
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", http_port))
            taken.listen()
            with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{http_port}"):
                await start(Config.model_validate(merge(BASE_CONFIG, tree)))
        assert not admin.exists()
        again = await start(Config.model_validate(merge(BASE_CONFIG, tree)))  # all free again
        try:
            assert again.addresses == [f"127.0.0.1:{grpc_port}"]
        finally:
            await again.stop(0)


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_oversized_fields_and_messages(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"limits": {"max_message_bytes": 64 * 1024}})
    qos = running.client
    with pytest.raises(InvalidRequest, match="tenant is 10000 characters"):
        await qos.acquire("P1", 10, tenant="x" * 10_000)
    # Above the transport limit gRPC itself refuses the message.
    with pytest.raises(QosdError, match="RESOURCE_EXHAUSTED"):
        await qos.acquire("P1", 10, tenant="x" * 100_000)
    # The daemon is unharmed.
    assert (await qos.acquire("P1", 10)).admitted


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_garbage_bytes_get_a_status_not_a_crash(make_daemon: DaemonFactory) -> None:
    running = await make_daemon()
    async with grpc.aio.insecure_channel(running.address) as channel:
        raw = channel.unary_unary("/qosd.v1.QoS/Acquire")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff\xff not a protobuf", timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid qosd.v1.AcquireRequest" in (info.value.details() or "")
    assert (await running.client.acquire("P1", 10)).admitted


@pytest.mark.parametrize("backend", ["embedded", "redis"], indirect=True)
async def test_deadline_shorter_than_max_wait_gets_an_answer(make_daemon: DaemonFactory) -> None:
    # P2 at 100 tokens/s (a tenth of a 1,000-token/s pool) from a 500-token burst: slow
    # enough that the caller's deadline can be 2 s, not 0.2, and still be too short
    # for the refill; a busy machine's slow round trip then cannot pass the deadline.
    slow = {"pools": {"default": {"capacity_tokens_s": 1_000}},
            "classes": {"P2": {"burst_tokens": 500}}}  # fmt: skip
    qos = (await make_daemon(slow)).client
    await qos.acquire("P2", 500, max_wait_ms=0, timeout_s=10)  # drain P2
    began = time.monotonic()
    result = await qos.acquire("P2", 400, max_wait_ms=10_000, timeout_s=2.0)
    elapsed = time.monotonic() - began
    # 400 tokens need ~4 s; the caller gives 2 s: qosd answers before the deadline.
    assert not result.admitted
    assert result.reason in (Reason.RATE_LIMITED, Reason.QUEUE_TIMEOUT)
    assert elapsed < 2.0


@pytest.mark.parametrize("backend", ["embedded", "redis", "cluster"], indirect=True)
async def test_cancelled_waiter_holds_nothing(make_daemon: DaemonFactory) -> None:
    running = await make_daemon()
    qos = running.client
    store = running.daemon.admission.store
    first = await qos.acquire("P2", 500, max_wait_ms=0)
    drained_at = time.monotonic()
    await qos.release(first.lease_id, input_tokens=500)  # settle so only waiters remain
    before = (await store.status(running.daemon.admission.pool("default"))).active_leases
    waiter = asyncio.create_task(qos.acquire("P2", 300, max_wait_ms=5_000))
    queued = await eventually(
        lambda: store.status(running.daemon.admission.pool("default")),
        lambda s: s.classes["P2"].waiting == 1,
    )
    assert queued.classes["P2"].waiting == 1  # it waits in the queue when cancelled
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # Past the moment it would have been admitted (0.3 s), and the bucket full (0.5 s).
    await asyncio.sleep(max(0.0, drained_at + 0.55 - time.monotonic()))
    assert (
        (await store.status(running.daemon.admission.pool("default"))).active_leases == before == 0
    )
    status = await store.status(running.daemon.admission.pool("default"))
    assert status.classes["P2"].tokens == pytest.approx(500)  # full again, nothing held
    assert status.classes["P2"].waiting == 0  # and no queue entry left behind


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_sync_client(make_daemon: DaemonFactory) -> None:
    running = await make_daemon()

    def use_sync_client() -> None:
        with SyncQosdClient(running.address) as qos:
            with qos.lease("P1", 1000, max_wait_ms=0) as lease:
                lease.set_usage(input_tokens=100, output_tokens=7)
            assert lease.release_result is not None
            assert lease.release_result.adjustment == pytest.approx(-900)
            with pytest.raises(Rejected) as info, qos.lease("P2", 10_000):
                pass
            assert info.value.reason is Reason.COST_EXCEEDS_BURST
            with pytest.raises(InvalidRequest):
                qos.acquire("nope", 1)
            assert qos.report([LatencySample("llama-3-8b", "P1", e2e_ms=3.0)]).accepted == 1

    await asyncio.to_thread(use_sync_client)


def test_unreachable_daemon_is_unavailable() -> None:
    with (
        closed_port() as port,  # held closed: no other worker's server can answer there
        SyncQosdClient(f"127.0.0.1:{port}", timeout_s=0.5) as qos,
        pytest.raises((Unavailable, qosd_client.DeadlineExceeded)),
    ):
        qos.acquire("P1", 10)


def test_sigterm_drains_waiters_and_exits(tmp_path: Path) -> None:
    # A reserved port, not port 0: after the daemon exits, nobody must listen there, and
    # the reservation keeps any other worker's server from taking the port meanwhile.
    with reserve_port() as reserved:
        listen = [f"127.0.0.1:{reserved.port}"]
        config = merge(BASE_CONFIG, {"server": {"listen": listen, "drain_grace_s": 5}})
        daemon = DaemonProcess(config, tmp_path).start()

        async def scenario() -> tuple[qosd_client.AcquireResult, float, int]:
            async with QosdClient(daemon.address) as qos:
                await qos.acquire("P2", 500, max_wait_ms=0)  # drain the bucket
                waiter = asyncio.create_task(qos.acquire("P2", 500, max_wait_ms=4_000))
                queued = await eventually(
                    lambda: qos.status("default"),
                    lambda s: s.pool("default").cls("P2").waiting == 1,
                )
                assert queued.pool("default").cls("P2").waiting == 1  # waiting at SIGTERM
                assert daemon.process is not None
                began = time.monotonic()
                daemon.process.send_signal(15)
                result = await waiter
                answered = time.monotonic() - began
                code = await asyncio.to_thread(daemon.process.wait, 30)
                return result, answered, code

        result, answered_after, code = asyncio.run(scenario())
        assert not result.admitted and result.reason is Reason.SHUTTING_DOWN
        assert result.retry_after_s == 1  # to another replica, in a second
        # At once, not at its 4 s wait or the 5 s grace: 2 s leaves a busy machine room.
        assert answered_after < 2.0
        assert code == 0
        with SyncQosdClient(daemon.address, timeout_s=10) as qos, pytest.raises(QosdError):
            qos.acquire("P1", 10)  # nobody listens any more


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qosd.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_bad_config_stops_start_up_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes:\n  P0: {priority: 0, share: 1.5}\n")
    result = run_cli("serve", "--config", str(bad))
    assert result.returncode == 2
    assert "classes.P0.share" in result.stderr
    assert "less than or equal to 1" in result.stderr


def test_config_check_prints_the_resolved_config(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("pools:\n  gpu-a: {capacity_tokens_s: 50000, models: [llama]}\n"
                    "default_pool: gpu-a\n")  # fmt: skip
    result = run_cli("config", "check", str(good))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["pools"]["gpu-a"]["capacity_tokens_s"] == 50000
    assert resolved["fail_mode"] == "closed"


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_grpcurl_lists_and_calls(make_daemon: DaemonFactory) -> None:
    """Reflection is enough for grpcurl: no .proto file on the caller's side."""
    running = await make_daemon()
    grpcurl = str(Path(sys.executable).parent / "grpcurl")

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=30, check=False
        )

    listed = await asyncio.to_thread(call, running.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"qosd.v1.QoS", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    request = '{"qosClass": "P1", "model": "llama-3-8b", "inputTokens": 1200}'
    acquired = await asyncio.to_thread(call, "-d", request, running.address, "qosd.v1.QoS/Acquire")
    assert acquired.returncode == 0, acquired.stderr
    answer = json.loads(acquired.stdout)
    assert answer["decision"] == "DECISION_ADMITTED"
    assert answer["tokens_charged"] == 1200  # grpcurl prints the proto field names
    invalid = await asyncio.to_thread(
        call, "-d", '{"qosClass": "P1", "inputTokens": -1}', running.address,
        "qosd.v1.QoS/Acquire",
    )  # fmt: skip
    assert invalid.returncode != 0
    assert (
        "InvalidArgument" in invalid.stderr and "input_tokens must be at least 1" in invalid.stderr
    )


class BrokenStore(EmbeddedStore):
    """A store with a bug: what callers see must be INTERNAL, and the daemon survives."""

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bucket arithmetic exploded")


async def test_a_bug_is_internal_not_unknown() -> None:
    config = Config.model_validate(merge(BASE_CONFIG, {}))
    daemon = await start(config, store=BrokenStore(tombstone_ms=1000))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            with pytest.raises(QosdError, match="INTERNAL: internal error: RuntimeError"):
                await qos.acquire("P1", 10)
            assert (await qos.report([LatencySample("llama-3-8b", "P1", e2e_ms=1.0)])).accepted
    finally:
        await daemon.stop(0)
