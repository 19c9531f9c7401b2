"""The metrics the dashboard and the alert rules read (helm/qosd/dashboards,
helm/qosd/rules): samples judged against their objectives, the in-flight bound, and
the served certificate's expiry."""

from __future__ import annotations

import datetime
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qosd.config import Config, ServerTlsConfig
from qosd.model import PrefillLearned
from qosd.server import Daemon, start
from qosd.tls import ServerCertificates, certificate_expiry
from qosd_client import LatencySample, Outcome, QosdClient
from tests.conftest import BASE_CONFIG, merge
from tests.test_metrics import _scrape, _value
from tests.tls import authority

CONFIG = merge(
    BASE_CONFIG,
    {
        "server": {"http_listen": "127.0.0.1:0"},
        "classes": {"P0": {"slo": {"ttft_ms": 500}}},
        "pools": {"default": {"max_in_flight": 4}},
    },
)


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    running = await start(Config.model_validate(CONFIG))
    yield running
    await running.stop(0)


async def test_samples_are_counted_met_or_missed_as_the_window_judges_them(
    daemon: Daemon,
) -> None:
    """P0 (TTFT objective 500 ms): 8 within it, one over, one failed (never met), one
    cancelled (not judged). P2 has no objectives: its sample is judged only when it
    states its own. The counters' ratio is the window's compliance gauge."""
    within = [LatencySample("llama-3-8b", "P0", ttft_ms=100 + i) for i in range(8)]
    async with QosdClient(daemon.addresses[0]) as qos:
        await qos.report(
            [
                *within,
                LatencySample("llama-3-8b", "P0", ttft_ms=900),
                LatencySample("llama-3-8b", "P0", ttft_ms=100, status=Outcome.ERROR),
                LatencySample("llama-3-8b", "P0", ttft_ms=100, status=Outcome.CANCELLED),
                LatencySample("llama-3-8b", "P2", ttft_ms=900),
                LatencySample("llama-3-8b", "P2", ttft_ms=900, slo_ttft_ms=1_000),
            ]
        )
    _, samples = await _scrape(daemon)
    p0 = {"pool": "default", "class": "P0"}
    met = _value(samples, "qosd_slo_samples_total", **p0, result="met")
    missed = _value(samples, "qosd_slo_samples_total", **p0, result="missed")
    assert (met, missed) == (8, 2)
    assert _value(samples, "qosd_slo_compliance_ratio", **p0) == pytest.approx(met / (met + missed))
    p2 = {"pool": "default", "class": "P2"}
    assert _value(samples, "qosd_slo_samples_total", **p2, result="met") == 1
    # Its other result is there from the first, at 0: a burn rate reads 0, not nothing.
    assert _value(samples, "qosd_slo_samples_total", **p2, result="missed") == 0
    p1 = {"pool": "default", "class": "P1"}  # no samples: no series
    assert ("qosd_slo_samples_total", frozenset({**p1, "result": "met"}.items())) not in samples


async def test_leases_in_flight_against_the_bound(daemon: Daemon) -> None:
    async with QosdClient(daemon.addresses[0]) as qos:
        held = await qos.acquire("P1", 300, model="llama-3-8b", expected_output_tokens=200)
        assert held.admitted
        _, samples = await _scrape(daemon)
        await qos.release(held.lease_id)
    assert _value(samples, "qosd_pool_max_in_flight", pool="default") == 4
    # Each pool's reset counter is there from the start, at 0 (a rate sees the first).
    assert _value(samples, "qosd_store_resets_total", pool="default") == 0
    assert _value(samples, "qosd_active_leases", pool="default") == 1
    assert _value(samples, "qosd_in_flight_tokens", pool="default") == 500
    # No bound on tokens was set: no series for it.
    assert ("qosd_pool_max_in_flight_tokens", frozenset({"pool": "default"}.items())) not in samples


async def test_the_prefill_backlog_is_what_the_store_holds_ahead() -> None:
    """A gated pool with a prefill model of 1 ms per prompt token: a 1,000-token prompt
    admitted puts 1 s of prefill ahead, which drains with the clock."""
    tree = merge(CONFIG, {"control": {"enabled": False}})  # the test states the model
    daemon = await start(Config.model_validate(tree))
    try:
        admission = daemon.admission
        _, samples = await _scrape(daemon)
        assert _value(samples, "qosd_prefill_backlog_seconds", pool="default") == 0
        await admission.store.set_prefill(
            admission.pool("default"),
            PrefillLearned(model=(0.0, 1.0, 0.0), tolerance_ms=None, usual_tokens=0),
        )
        async with QosdClient(daemon.addresses[0]) as qos:
            assert (await qos.acquire("P1", 1_000, model="llama-3-8b")).admitted
        _, samples = await _scrape(daemon)
    finally:
        await daemon.stop(0)
    assert 0.5 < _value(samples, "qosd_prefill_backlog_seconds", pool="default") <= 1.0


def _server_certificate(
    directory: Path, name: str, not_after: datetime.datetime
) -> tuple[Path, Path]:
    """A server certificate valid until ``not_after``, and its key."""
    issuer = authority(directory, f"{name}-ca")
    pem = issuer.issue(directory, name, server=True, not_after=not_after)
    return pem.cert, pem.key


@pytest.mark.parametrize(
    "not_after",
    [
        datetime.datetime(2031, 7, 9, 13, 14, 15, tzinfo=datetime.UTC),  # UTCTime
        datetime.datetime(2061, 2, 3, 4, 5, 6, tzinfo=datetime.UTC),  # GeneralizedTime
    ],
    ids=["utctime", "generalizedtime"],
)
def test_certificate_expiry_reads_not_after(tmp_path: Path, not_after: datetime.datetime) -> None:
    cert, _ = _server_certificate(tmp_path, "qosd", not_after)
    assert certificate_expiry(cert.read_bytes()) == not_after.timestamp()
    with pytest.raises(ValueError):
        certificate_expiry(b"not a certificate")


def test_the_expiry_is_told_at_start_and_at_each_rotation(tmp_path: Path) -> None:
    first = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    cert, key = _server_certificate(tmp_path, "first", first)
    told: list[float] = []
    certificates = ServerCertificates(
        ServerTlsConfig(cert_file=str(cert), key_file=str(key)), on_expiry=told.append
    )
    assert told == [first.timestamp()]
    second = datetime.datetime(2030, 4, 1, tzinfo=datetime.UTC)
    new_cert, new_key = _server_certificate(tmp_path, "second", second)
    os.replace(new_cert, cert)
    os.replace(new_key, key)
    assert certificates.refresh(force=True)
    assert told == [first.timestamp(), second.timestamp()]


async def test_a_daemon_with_tls_shows_its_certificate_expiry(tmp_path: Path) -> None:
    not_after = datetime.datetime(2032, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    cert, key = _server_certificate(tmp_path, "qosd", not_after)
    tree = merge(CONFIG, {"server": {"tls": {"cert_file": str(cert), "key_file": str(key)}}})
    daemon = await start(Config.model_validate(tree))
    try:
        page = await daemon.metrics_page()
    finally:
        await daemon.stop(0)
    (expiry,) = [
        sample
        for family in text_string_to_metric_families(page.decode())
        for sample in family.samples
        if sample.name == "qosd_tls_certificate_expiry_timestamp_seconds"
    ]
    assert expiry.labels == {"file": str(cert)}
    assert expiry.value == not_after.timestamp()


async def test_no_expiry_series_without_tls(daemon: Daemon) -> None:
    assert b"qosd_tls_certificate_expiry_timestamp_seconds{" not in await daemon.metrics_page()
