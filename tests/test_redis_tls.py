"""TLS to Redis: a server certificate from a private CA, and a client certificate for a
server that requires one (tls-auth-clients), given in the config (or the environment,
as a chart mounting a Secret gives them) or in the rediss:// URL. A real redis-server
with TLS on, started here."""

from __future__ import annotations

import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from qosd.config import ConfigError, load_config
from qosd.server import start
from qosd_client import QosdClient, Reason
from qosd_harness import PortReservation, redis_server_binary, spawn_on_reserved_port
from tests.tls import Authority, Pem, authority


@dataclass(frozen=True)
class TlsRedis:
    port: int
    ca: Authority
    client: Pem
    directory: Path

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"


def _answers_over_tls(port: int, ca: Path, client: Pem) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(client.cert), str(client.key))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), 0.5) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.sendall(b"PING\r\n")
            return tls.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[TlsRedis]:
    with tempfile.TemporaryDirectory(prefix="qosd-redis-tls-") as name:
        directory = Path(name)
        ca = authority(directory)
        server = ca.issue(directory, "redis", server=True)
        client = ca.issue(directory, "qosd", server=False)
        process, reservation = _start_tls_redis(directory, ca, server)
        port = reservation.port
        try:
            deadline = time.monotonic() + 30
            while not _answers_over_tls(port, ca.cert, client):
                assert process.poll() is None, (directory / "redis.log").read_text()
                assert time.monotonic() < deadline, "redis-server with TLS did not answer"
                time.sleep(0.02)
            yield TlsRedis(port, ca, client, directory)
        finally:
            process.kill()
            process.wait(5)
            reservation.close()


def _start_tls_redis(
    directory: Path, ca: Authority, server: Pem
) -> tuple[subprocess.Popen[bytes], PortReservation]:
    """redis-server with TLS only, on a reserved port (it cannot bind port 0 and say
    which it got), listening there itself; on another port if it found one taken."""
    log = directory / "redis.log"

    def argv_for(port: int) -> list[str]:
        return [
            redis_server_binary(),
            "--port", "0",
            "--tls-port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(directory),
            "--logfile", str(log),
            "--tls-cert-file", str(server.cert),
            "--tls-key-file", str(server.key),
            "--tls-ca-cert-file", str(ca.cert),
            "--tls-auth-clients", "yes",
        ]  # fmt: skip

    return spawn_on_reserved_port("redis-server", argv_for, log)


async def _first_answer(env: dict[str, str]) -> Reason:
    daemon = await start(load_config(env={"QOSD_LISTEN": "127.0.0.1:0", **env}))
    try:
        async with QosdClient(daemon.addresses[0]) as qos:
            return (await qos.acquire("P1", 10)).reason
    finally:
        await daemon.stop(0)


async def test_a_private_ca_and_a_client_certificate_from_the_config(tls_redis: TlsRedis) -> None:
    env = {
        "QOSD_REDIS_URL": tls_redis.url,
        "QOSD_REDIS_TLS_CA_FILE": str(tls_redis.ca.cert),
        "QOSD_REDIS_TLS_CERT_FILE": str(tls_redis.client.cert),
        "QOSD_REDIS_TLS_KEY_FILE": str(tls_redis.client.key),
    }
    assert await _first_answer(env) is Reason.NONE


async def test_the_same_files_named_in_the_url(tls_redis: TlsRedis) -> None:
    query = (
        f"ssl_ca_certs={tls_redis.ca.cert}&ssl_certfile={tls_redis.client.cert}"
        f"&ssl_keyfile={tls_redis.client.key}"
    )
    assert await _first_answer({"QOSD_REDIS_URL": f"{tls_redis.url}?{query}"}) is Reason.NONE


async def test_without_a_client_certificate_the_server_refuses_and_qosd_fails_closed(
    tls_redis: TlsRedis,
) -> None:
    env = {"QOSD_REDIS_URL": tls_redis.url, "QOSD_REDIS_TLS_CA_FILE": str(tls_redis.ca.cert)}
    assert await _first_answer(env) is Reason.BACKEND_UNAVAILABLE


async def test_a_server_certificate_from_another_ca_is_not_trusted(tls_redis: TlsRedis) -> None:
    other = authority(tls_redis.directory, "another-ca")
    env = {
        "QOSD_REDIS_URL": tls_redis.url,
        "QOSD_REDIS_TLS_CA_FILE": str(other.cert),
        "QOSD_REDIS_TLS_CERT_FILE": str(tls_redis.client.cert),
        "QOSD_REDIS_TLS_KEY_FILE": str(tls_redis.client.key),
    }
    assert await _first_answer(env) is Reason.BACKEND_UNAVAILABLE


def test_tls_settings_are_checked_at_load_naming_the_field(tmp_path: Path) -> None:
    pem = tmp_path / "ca.crt"
    pem.write_text("not read until start")
    cases = {
        "redis: tls: needs a rediss:// url": {
            "QOSD_REDIS_URL": "redis://127.0.0.1:1/0",
            "QOSD_REDIS_TLS_CA_FILE": str(pem),
        },
        "redis.tls.ca_file": {
            "QOSD_REDIS_URL": "rediss://127.0.0.1:1/0",
            "QOSD_REDIS_TLS_CA_FILE": str(tmp_path / "missing.crt"),
        },
        "redis.tls: cert_file and key_file go together": {
            "QOSD_REDIS_URL": "rediss://127.0.0.1:1/0",
            "QOSD_REDIS_TLS_CERT_FILE": str(pem),
        },
    }
    for words, env in cases.items():
        with pytest.raises(ConfigError) as info:
            load_config(env=env)
        assert words in str(info.value), str(info.value)
    # No tls settings: the system's CAs, no client certificate.
    assert load_config(env={"QOSD_REDIS_URL": "rediss://127.0.0.1:1/0"}).redis.tls is None
