"""``GET /metrics``: what the daemon decided and how its store answered, counted as it
happens; budgets, queues and the SLO loop's state read at scrape time; and output that
``promtool check metrics`` accepts."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qosd.config import Config
from qosd.metrics import TopTenants
from qosd.server import Daemon, start
from qosd_client import (
    InvalidRequest,
    LatencySample,
    QosdClient,
    Reason,
    ServerLoad,
    Unauthenticated,
)
from qosd_harness import RedisServer, redis_server
from tests.conftest import BASE_CONFIG, merge
from tests.waiting import eventually

CONFIG = merge(
    BASE_CONFIG,
    {
        "server": {"http_listen": "127.0.0.1:0"},
        "classes": {"P0": {"slo": {"ttft_ms": 500}}},
    },
)


async def _scrape(
    daemon: Daemon,
) -> tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    assert daemon.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{daemon.http.address}/metrics") as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return text, samples


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    (tmp_path / "control-token").write_text("metrics-operator\n")
    config = merge(CONFIG, {"auth": {"control": {"token_file": str(tmp_path / "control-token")}}})
    running = await start(Config.model_validate(config))
    yield running
    await running.stop(0)


async def test_metrics_count_what_happened(daemon: Daemon) -> None:
    async with QosdClient(daemon.addresses[0]) as qos:
        for _ in range(3):
            result = await qos.acquire("P0", 100, model="llama-3-8b")
            assert result.admitted
            await qos.release(result.lease_id, output_tokens=10)
        # P0's 6,000 tokens/s bucket holds 3,000: a request for more is refused.
        refused = await qos.acquire("P0", 9_000, model="llama-3-8b", max_wait_ms=0)
        assert refused.reason is Reason.COST_EXCEEDS_BURST
        with pytest.raises(InvalidRequest):
            await qos.acquire("P7", 10, model="llama-3-8b")
        await qos.report(
            [LatencySample("llama-3-8b", "P0", ttft_ms=100 + i, tpot_ms=20) for i in range(9)]
            + [LatencySample("llama-3-8b", "P0", ttft_ms=900, tpot_ms=20)],
            loads=[ServerLoad("llama-3-8b", "triton-0", waiting_requests=4)],
        )
        with pytest.raises(Unauthenticated, match="control calls need"):
            await qos.pin_rate("default", 8_000)  # no token
        token_file = daemon.config.auth.control.token_file
        async with QosdClient(daemon.addresses[0], token_file=token_file) as operator:
            await operator.pin_rate("default", 8_000)
        status = (await qos.status("default")).pool("default")

    text, samples = await _scrape(daemon)
    pool = {"pool": "default", "class": "P0"}
    admitted = {**pool, "decision": "admitted", "reason": "NONE"}
    assert _value(samples, "qosd_acquire_decisions_total", **admitted) == 3
    refused_labels = {**pool, "decision": "rejected", "reason": "COST_EXCEEDS_BURST"}
    assert _value(samples, "qosd_acquire_decisions_total", **refused_labels) == 1
    assert _value(samples, "qosd_invalid_requests_total", rpc="Acquire") == 1
    assert _value(samples, "qosd_releases_total", outcome="OK", result="OK") == 3
    assert _value(samples, "qosd_report_samples_total", result="accepted") == 10
    assert _value(samples, "qosd_store_call_seconds_count", call="acquire") >= 4
    assert _value(samples, "qosd_rate_adjustments_total", pool="default", kind="pin") == 1
    unauthenticated = {"method": "qosd.v1.Admin/PinRate", "code": "UNAUTHENTICATED"}
    assert _value(samples, "qosd_auth_refusals_total", **unauthenticated) == 1
    # State, as GetStatus reports it.
    assert _value(samples, "qosd_pool_rate_tokens_per_second", pool="default") == 8_000
    assert _value(samples, "qosd_pool_pinned", pool="default") == 1
    assert _value(samples, "qosd_class_rate_tokens_per_second", **pool) == pytest.approx(
        status.cls("P0").rate_tokens_s
    )
    assert _value(samples, "qosd_queue_depth", **pool) == 0
    assert _value(samples, "qosd_slo_compliance_ratio", **pool) == pytest.approx(0.9)
    p99 = _value(samples, "qosd_latency_seconds", **pool, metric="ttft", percentile="p99")
    assert p99 == pytest.approx(0.9)
    assert (
        "qosd_slo_compliance_ratio",
        frozenset({"pool": "default", "class": "P2"}.items()),
    ) not in samples  # no objectives
    assert _value(samples, "qosd_active_leases", pool="default") == 0  # all released
    assert _value(samples, "qosd_server_waiting_requests", pool="default") == 4
    assert ("qosd_server_kv_cache_usage", frozenset({"pool": "default"}.items())) not in samples
    assert _value(samples, "qosd_store_up") == 1
    _promtool_accepts(text)


def _promtool_accepts(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed (apt-get install prometheus; .ci/run installs it)"
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


async def test_only_the_top_tenants_are_series(daemon: Daemon) -> None:
    """Thirty tenants admitted in P1, tenant n with 10 x n tokens: the page shows the
    ten heaviest, each with the tokens it was admitted, and no other tenant."""
    async with QosdClient(daemon.addresses[0]) as qos:
        for n in range(1, 31):
            result = await qos.acquire("P1", 10 * n, tenant=f"tenant-{n}", model="llama-3-8b")
            assert result.admitted
            await qos.release(result.lease_id)
    _, samples = await _scrape(daemon)
    shown = {
        dict(labels)["tenant"]: value
        for (name, labels), value in samples.items()
        if name == "qosd_tenant_admitted_tokens"
    }
    assert shown == {f"tenant-{n}": 10 * n for n in range(21, 31)}


async def test_a_stalled_loop_shows_in_the_loop_lag(daemon: Daemon) -> None:
    """The daemon's loop is held for 300 ms (a long callback, as a stop-the-world
    collection or a starved CPU holds it): the probe, due within the first 50 ms of
    the stall, wakes at least 250 ms late, and the page says so."""

    async def lag_over_200ms() -> float:
        _, samples = await _scrape(daemon)
        name = "qosd_event_loop_lag_seconds_bucket"
        return _value(samples, name, le="+Inf") - _value(samples, name, le="0.2")

    before = await lag_over_200ms()
    time.sleep(0.3)  # noqa: ASYNC251 (the stall itself, on the daemon's loop: not a wait)
    assert await eventually(lag_over_200ms, lambda late: late > before) > before


async def test_a_failed_state_read_costs_the_page_its_state_only(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe: a status read that failed other than by the store being away (an
    embedded store's reply too long for Lua, before that was fixed) answered /metrics
    with a 500, for every scraper. Now the page still has the counters, and the
    failure is logged."""
    async with QosdClient(daemon.addresses[0]) as qos:
        assert (await qos.acquire("P1", 10, model="llama-3-8b")).admitted

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a read that failed")

    _, before = await _scrape(daemon)
    assert _value(before, "qosd_pool_rate_tokens_per_second", pool="default") > 0
    monkeypatch.setattr(daemon.status, "status", failing)
    _, samples = await _scrape(daemon)
    admitted = {"pool": "default", "class": "P1", "decision": "admitted", "reason": "NONE"}
    assert _value(samples, "qosd_acquire_decisions_total", **admitted) == 1
    assert _value(samples, "qosd_state_read_failures_total") == 1
    # No state at all, rather than the last read's as if it were current.
    assert not any(name == "qosd_pool_rate_tokens_per_second" for name, _ in samples)
    assert "/metrics: the state read failed" in caplog.text


def test_the_top_tenants_stay_bounded_and_keep_the_heavy_ones() -> None:
    """10,000 tenants of 1 token each and one of 5,000: 40 slots, and the heavy one is
    first, its count overstated by at most the lightest slot's."""
    top = TopTenants(k=10)
    for n in range(10_000):
        top.add(f"light-{n}", 1)
        if n % 2 == 0:
            top.add("heavy", 1)
    first, count = top.top()[0]
    assert first == "heavy" and 5_000 <= count <= 5_000 + 10_000 / 40
    assert len(top.top()) == 10 and top.tracked == 40


async def test_store_errors_and_store_up(own_redis: RedisServer) -> None:
    config = merge(
        CONFIG,
        {
            "redis": {
                "url": own_redis.url,
                "key_prefix": f"t{uuid.uuid4().hex[:12]}",
                "timeout_ms": 100,
                "connect_timeout_ms": 100,
                "retry_interval_ms": 200,
            }
        },
    )
    daemon = await start(Config.model_validate(config))
    try:
        own_redis.kill()
        async with QosdClient(daemon.addresses[0]) as qos:
            result = await qos.acquire("P1", 10, model="llama-3-8b")
        assert result.reason is Reason.BACKEND_UNAVAILABLE
        text, samples = await _scrape(daemon)
        assert _value(samples, "qosd_store_errors_total", call="acquire") >= 1
        assert _value(samples, "qosd_store_up") == 0
        labels = {"pool": "default", "class": "P1", "decision": "rejected"}
        assert (
            _value(samples, "qosd_acquire_decisions_total", **labels, reason="BACKEND_UNAVAILABLE")
            == 1
        )
        _promtool_accepts(text)
    finally:
        await daemon.stop(0)
