"""TLS, mTLS and authorization on a running daemon, over real sockets: who may call
what (docs/security.md), and certificates and tokens rotated on disk with no restart."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qosd.config import Config, ConfigError, load_config
from qosd.server import Daemon, start
from qosd.tls import CHECK_INTERVAL_S
from qosd_client import (
    ClientTls,
    PermissionDenied,
    QosdClient,
    QosdError,
    Unauthenticated,
    Unavailable,
)
from tests.conftest import BASE_CONFIG, merge
from tests.tls import Authority, Pem, authority
from tests.waiting import eventually

OPERATOR = "spiffe://fleet.example/ns/ops/sa/operator"
GATEWAY = "spiffe://fleet.example/ns/llm/sa/gateway"


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return authority(tmp_path)


@pytest.fixture
def served(tmp_path: Path, ca: Authority) -> Path:
    """The daemon's certificate as a mounted Secret holds it: tls.crt and tls.key in
    one directory, replaced in place on rotation."""
    pem = ca.issue(tmp_path, "qosd", server=True)
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(pem.cert, secret / "tls.crt")
    shutil.copy(pem.key, secret / "tls.key")
    return secret


def tls_config(secret: Path, ca: Authority | None = None, **auth: Any) -> dict[str, Any]:
    tls: dict[str, Any] = {
        "cert_file": str(secret / "tls.crt"),
        "key_file": str(secret / "tls.key"),
    }
    if ca is not None:
        tls["client_ca_file"] = str(ca.cert)
    return merge(
        BASE_CONFIG,
        {"server": {"listen": ["127.0.0.1:0"], "http_listen": "127.0.0.1:0", "tls": tls},
         "auth": auth},
    )  # fmt: skip


@pytest.fixture
async def daemons() -> AsyncIterator[list[Daemon]]:
    running: list[Daemon] = []
    yield running
    for daemon in running:
        await daemon.stop(0)


async def started(daemons: list[Daemon], tree: dict[str, Any]) -> Daemon:
    daemon = await start(Config.model_validate(tree))
    daemons.append(daemon)
    return daemon


def client(daemon: Daemon, ca: Authority, pem: Pem | None = None, **kwargs: Any) -> QosdClient:
    tls = ClientTls(str(ca.cert), str(pem.cert) if pem else None, str(pem.key) if pem else None)
    return QosdClient(daemon.addresses[0], tls=tls, timeout_s=3.0, **kwargs)


async def https_get(daemon: Daemon, ca_file: Path, path: str = "/healthz") -> int:
    assert daemon.http is not None
    context = ssl.create_default_context(cafile=str(ca_file))
    async with aiohttp.ClientSession() as session:
        url = f"https://{daemon.http.address}{path}"
        async with session.get(url, ssl=context) as response:
            return response.status


def rotate(secret: Path, ca: Authority, directory: Path) -> None:
    """As the kubelet updates a Secret volume: new files, swapped in by rename."""
    pem = ca.issue(directory, "qosd-rotated", server=True)
    for source, name in ((pem.cert, "tls.crt"), (pem.key, "tls.key")):
        shutil.copy(source, secret / f".{name}.new")
        os.replace(secret / f".{name}.new", secret / name)


async def test_tls_serves_grpc_and_http_and_refuses_plaintext(
    daemons: list[Daemon], served: Path, ca: Authority
) -> None:
    daemon = await started(daemons, tls_config(served))
    async with client(daemon, ca) as qos:
        assert (await qos.acquire("P1", 10, max_wait_ms=0)).admitted
    async with QosdClient(daemon.addresses[0], timeout_s=2.0) as plain:
        with pytest.raises(Unavailable):
            await plain.acquire("P1", 10, max_wait_ms=0)
    assert await https_get(daemon, ca.cert) == 200
    assert await https_get(daemon, ca.cert, "/metrics") == 200


async def test_rotated_certificates_are_served_without_a_restart(
    daemons: list[Daemon], served: Path, ca: Authority, tmp_path: Path
) -> None:
    daemon = await started(daemons, tls_config(served))
    async with client(daemon, ca) as before:
        assert (await before.acquire("P1", 10, max_wait_ms=0)).admitted
        # A new CA altogether: a client that trusts only it proves the new pair is served.
        (tmp_path / "renewed").mkdir()
        renewed = authority(tmp_path / "renewed", "qosd-renewed-ca")
        rotate(served, renewed, tmp_path / "renewed")
        certificates = daemon.certificates
        assert certificates is not None

        async def renewed_answers() -> bool:
            async with client(daemon, renewed) as fresh:
                try:
                    return (await fresh.acquire("P1", 10, max_wait_ms=0)).admitted
                except Unavailable:
                    return False  # still the old certificate: the next look is due

        # Files are looked at once a second at most, at a handshake.
        assert await eventually(renewed_answers, bool, timeout_s=10 * CHECK_INTERVAL_S)
        assert certificates.generation == 1
        # The connection opened before keeps working on its own certificate.
        assert (await before.acquire("P1", 10, max_wait_ms=0)).admitted
    assert await https_get(daemon, renewed.cert) == 200  # HTTP took the new pair too
    text = await _metrics(daemon, renewed.cert)
    assert 'qosd_tls_certificate_reloads_total{result="loaded"} 1.0' in text


async def test_a_rotation_that_does_not_load_keeps_the_old_certificate(
    daemons: list[Daemon], served: Path, ca: Authority
) -> None:
    daemon = await started(daemons, tls_config(served))
    certificates = daemon.certificates
    assert certificates is not None
    (served / "tls.key").write_text("-----BEGIN PRIVATE KEY-----\nhalf written\n")
    assert not certificates.refresh(force=True)
    assert not certificates.refresh(force=True)  # the same bad files: counted once
    async with client(daemon, ca) as qos:
        assert (await qos.acquire("P1", 10, max_wait_ms=0)).admitted
    assert 'qosd_tls_certificate_reloads_total{result="failed"} 1.0' in await _metrics(
        daemon, ca.cert
    )


async def _metrics(daemon: Daemon, ca_file: Path) -> str:
    assert daemon.http is not None
    context = ssl.create_default_context(cafile=str(ca_file))
    async with aiohttp.ClientSession() as session:
        url = f"https://{daemon.http.address}/metrics"
        async with session.get(url, ssl=context) as response:
            return await response.text()


async def test_mtls_requires_a_client_certificate_and_authorizes_by_identity(
    daemons: list[Daemon], served: Path, ca: Authority, tmp_path: Path
) -> None:
    tree = tls_config(
        served, ca, control={"identities": [OPERATOR]}, qos={"identities": [GATEWAY, OPERATOR]}
    )
    daemon = await started(daemons, tree)
    gateway = ca.issue(tmp_path, "gateway", server=False, uri=GATEWAY)
    operator = ca.issue(tmp_path, "operator", server=False, uri=OPERATOR)
    stranger = ca.issue(tmp_path, "stranger", server=False, uri="spiffe://elsewhere/sa/x")
    async with client(daemon, ca) as anonymous:  # TLS, but no certificate
        with pytest.raises(Unavailable):
            await anonymous.acquire("P1", 10, max_wait_ms=0)
    async with client(daemon, ca, gateway) as qos:
        assert (await qos.acquire("P1", 10, max_wait_ms=0)).admitted
        with pytest.raises(PermissionDenied, match=f"client identity {GATEWAY} is not in auth"):
            await qos.pin_rate("default", 5_000)
    async with client(daemon, ca, operator) as ops:
        assert (await ops.pin_rate("default", 5_000)).pinned
    async with client(daemon, ca, stranger) as other:
        with pytest.raises(PermissionDenied, match=r"auth\.qos\.identities"):
            await other.acquire("P1", 10, max_wait_ms=0)
    # Health stays open to any client the TLS layer lets in (probes).
    async with grpc.aio.secure_channel(
        daemon.addresses[0],
        grpc.ssl_channel_credentials(
            ca.cert.read_bytes(), stranger.key.read_bytes(), stranger.cert.read_bytes()
        ),
    ) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    text = await _metrics(daemon, ca.cert)
    assert (
        'qosd_auth_refusals_total{code="PERMISSION_DENIED",method="qosd.v1.Admin/PinRate"} 1.0'
        in text
    )
    assert (
        'qosd_auth_refusals_total{code="PERMISSION_DENIED",method="qosd.v1.QoS/Acquire"} 1.0'
        in text
    )


async def test_bearer_tokens_are_checked_and_reread_when_rotated(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    token = tmp_path / "qos-token"
    token.write_text("first-token\n")
    tree = merge(BASE_CONFIG, {"auth": {"qos": {"token_file": str(token)}}})
    daemon = await started(daemons, tree)
    address = daemon.addresses[0]
    mine = tmp_path / "client-token"
    mine.write_text("first-token")
    async with QosdClient(address) as anonymous:
        with pytest.raises(Unauthenticated, match="qos calls need an 'authorization: Bearer"):
            await anonymous.acquire("P1", 10, max_wait_ms=0)
        with pytest.raises(Unauthenticated):
            await anonymous.status()
    async with QosdClient(address, token_file=str(mine)) as qos:
        assert (await qos.acquire("P1", 10, max_wait_ms=0)).admitted
        # The operator rotates the Secret: the old token stops working at once ...
        token.write_text("second-token\n")
        with pytest.raises(PermissionDenied, match="the bearer token is not accepted"):
            await qos.acquire("P1", 10, max_wait_ms=0)
        # ... and the client, whose own file was rotated too, follows.
        mine.write_text("second-token")
        assert (await qos.acquire("P1", 10, max_wait_ms=0)).admitted
        # Control calls: no auth.control rule, so not on this listener at all.
        with pytest.raises(PermissionDenied, match=r"server\.admin_listen"):
            await qos.pin_rate("default", 5_000)


async def test_the_admin_socket_serves_control_calls_without_credentials(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    token = tmp_path / "qos-token"
    token.write_text("gateway-token\n")
    socket = f"unix:{tmp_path}/a.sock"
    tree = merge(
        BASE_CONFIG,
        {"server": {"admin_listen": [socket]}, "auth": {"qos": {"token_file": str(token)}}},
    )
    daemon = await started(daemons, tree)
    assert daemon.admin_addresses == [socket]
    async with QosdClient(socket) as admin:
        assert (await admin.pin_rate("default", 5_000)).pinned
        assert (await admin.status()).pool("default").pinned  # GetStatus too, no token
        with pytest.raises(QosdError, match="UNIMPLEMENTED"):
            await admin.acquire("P1", 10, max_wait_ms=0)  # QoS is not served there
    assert (tmp_path / "a.sock").stat().st_mode & 0o777 == 0o660


def test_configuration_errors_name_the_field(tmp_path: Path, served: Path) -> None:
    cases = {
        "server:\n  admin_listen: ['0.0.0.0:9000']\n": "server.admin_listen",
        "server:\n  tls:\n    cert_file: /nonexistent.crt\n": "server.tls.cert_file",
        f"server:\n  tls:\n    cert_file: {served}/tls.crt\n": "cert_file and key_file go together",
        f"server:\n  tls:\n    client_ca_file: {served}/tls.crt\n": "client_ca_file needs",
        "auth:\n  control:\n    identities: [x]\n": "auth.control.identities",
        "auth:\n  qos:\n    token_file: /nonexistent\n": "auth.qos.token_file",
    }
    for text, named in cases.items():
        path = tmp_path / "qosd.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
            load_config(str(path), env={})


async def test_a_daemon_on_defaults_refuses_an_anonymous_pin_rate_over_tcp(
    daemons: list[Daemon],
) -> None:
    """The built-in defaults (only the port changed, to a free one): a control call
    from anyone who can reach the TCP port is refused, and changes nothing."""
    daemon = await started(daemons, {"server": {"listen": ["127.0.0.1:0"]}})
    async with QosdClient(daemon.addresses[0]) as anonymous:
        with pytest.raises(PermissionDenied, match=r"server\.admin_listen"):
            await anonymous.pin_rate("default", 1)
        with pytest.raises(PermissionDenied):
            await anonymous.unpin_rate("default")
        assert not (await anonymous.status()).pool("default").pinned
        assert (await anonymous.acquire("P1", 10, max_wait_ms=0)).admitted  # QoS is open


def grpcurl(*args: str, works: bool = True) -> subprocess.CompletedProcess[str]:
    """grpcurl with ``args``. A call expected to be turned away at the handshake gets a
    2 s dial limit, not 10 s: grpcurl redials until its limit and then says only
    "context deadline exceeded" either way."""
    binary = str(Path(sys.executable).parent / "grpcurl")
    limit = "10" if works else "2"
    return subprocess.run(
        [binary, "-max-time", "10", "-connect-timeout", limit, *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


ACQUIRE = ("-d", '{"qos_class": "P1", "input_tokens": 10, "max_wait_ms": 0}')


async def test_grpcurl_and_the_client_over_tls_and_mtls(
    daemons: list[Daemon], served: Path, ca: Authority, tmp_path: Path
) -> None:
    """grpcurl (with reflection) and QosdClient reach a TLS listener with the CA, and an
    mTLS one with a certificate that CA signed; a certificate another CA signed, or
    none, is turned away at the handshake."""
    tls_only = await started(daemons, tls_config(served))
    address = tls_only.addresses[0]
    answer = await asyncio.to_thread(
        grpcurl, "-cacert", str(ca.cert), *ACQUIRE, address, "qosd.v1.QoS/Acquire"
    )
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout)["decision"] == "DECISION_ADMITTED"
    plain = await asyncio.to_thread(
        grpcurl, "-plaintext", *ACQUIRE, address, "qosd.v1.QoS/Acquire", works=False
    )
    assert plain.returncode != 0

    mutual = await started(daemons, tls_config(served, ca))
    address = mutual.addresses[0]
    trusted = ca.issue(tmp_path, "gateway", server=False, uri=GATEWAY)
    (tmp_path / "elsewhere").mkdir()
    stranger_ca = authority(tmp_path / "elsewhere", "another-ca")
    untrusted = stranger_ca.issue(tmp_path / "elsewhere", "impostor", server=False, uri=GATEWAY)
    for pem, works in ((trusted, True), (untrusted, False), (None, False)):
        identity = ("-cert", str(pem.cert), "-key", str(pem.key)) if pem else ()
        answer = await asyncio.to_thread(
            functools.partial(grpcurl, works=works),
            "-cacert", str(ca.cert), *identity, *ACQUIRE, address, "qosd.v1.QoS/Acquire",
        )  # fmt: skip
        assert (answer.returncode == 0) is works, (pem, answer.stderr)
        async with client(mutual, ca, pem) as qos:
            if works:
                assert (await qos.acquire("P1", 10, max_wait_ms=0)).admitted
            else:
                with pytest.raises(Unavailable):
                    await qos.acquire("P1", 10, max_wait_ms=0)
