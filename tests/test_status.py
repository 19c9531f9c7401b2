"""One status, three readers: Admin/GetStatus, /metrics and qosctl show what the
status service (qosd/status.py) read, in the domain dataclasses the client returns."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from qosd.ctl import render
from qosd_client import LatencySample, ServerLoad
from qosd_client._convert import status_message, status_result
from qosd_client.types import PoolState, Status, TenantState
from tests.conftest import DaemonFactory


def gauges(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on a /metrics page, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }


def steady(pool: PoolState) -> tuple[object, ...]:
    """What two reads a moment apart agree on (balances refill, ages grow)."""
    return (
        pool.name,
        pool.pinned,
        pool.admitted_rate_tokens_s,
        pool.active_leases,
        pool.server_waiting_requests,
        pool.server_kv_cache_usage,
        [(c.name, c.waiting, c.in_flight, c.rate_tokens_s, c.latency) for c in pool.classes],
        [(h.from_tokens_s, h.to_tokens_s, h.reason, h.by) for h in pool.history],
    )


async def test_getstatus_metrics_and_qosctl_show_one_status(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"classes": {"P1": {"fairness": "vtc"}}})
    daemon = running.daemon
    lease = await running.client.acquire("P0", 1_000, model="llama-3-8b")
    assert lease.admitted
    fair = await running.client.acquire("P1", 300, tenant="acme", max_wait_ms=0)
    assert fair.admitted
    samples = [
        LatencySample("llama-3-8b", "P0", ttft_ms=100.0 + i, tpot_ms=20.0, e2e_ms=900.0)
        for i in range(10)
    ]
    loads = [ServerLoad("llama-3-8b", "gpu-0", waiting_requests=3, kv_cache_usage=0.5)]
    reported = await running.client.report(samples, loads=loads)
    assert reported.accepted == 10 and reported.loads_accepted == 1
    await running.admin.pin_rate("default", 8_000)

    status = await daemon.status.status(daemon.status.pool_names(), 5, ["acme"])
    assert isinstance(status, Status)
    pool = status.pool("default")
    assert pool.pinned and pool.admitted_rate_tokens_s == 8_000
    assert pool.active_leases == 2 and pool.cls("P0").in_flight == 1
    assert pool.cls("P1").fairness == "vtc" and pool.cls("P0").fairness == "fifo"
    assert pool.cls("P1").tenant("acme") == TenantState("acme", 1.0, True, 300.0, 300.0, 0)
    assert pool.server_waiting_requests == 3 and pool.server_kv_cache_usage == 0.5
    ttft = pool.cls("P0").latency.ttft
    assert ttft is not None and ttft.p50_ms >= 100.0
    assert [(h.from_tokens_s, h.to_tokens_s) for h in pool.history] == [(10_000, 8_000)]

    # GetStatus carries it whole: the daemon's mapping to protobuf and the client's
    # back are inverse (one file holds both, qosd_client/_convert.py).
    assert status_result(status_message(status)) == status

    # Over gRPC, the client reads the same status (balances refill meanwhile).
    fetched = await running.client.status(history=5, tenants=["acme"])
    assert fetched.daemon_id == status.daemon_id and fetched.store == status.store
    assert steady(fetched.pool("default")) == steady(pool)
    assert fetched.pool("default").cls("P1").tenants == pool.cls("P1").tenants

    # /metrics sets its gauges from the same read.
    page = gauges((await daemon.metrics_page()).decode())
    by_pool = (("pool", "default"),)
    assert page[("qosd_pool_rate_tokens_per_second", by_pool)] == 8_000
    assert page[("qosd_pool_pinned", by_pool)] == 1
    assert page[("qosd_active_leases", by_pool)] == 2
    p0 = (("class", "P0"), ("pool", "default"))
    assert page[("qosd_class_rate_tokens_per_second", p0)] == pool.cls("P0").rate_tokens_s
    assert page[("qosd_latency_window_samples", p0)] == 10
    p99 = (("class", "P0"), ("metric", "ttft"), ("percentile", "p99"), ("pool", "default"))
    assert page[("qosd_latency_seconds", p99)] == ttft.p99_ms / 1000

    # And qosctl renders the client's read of it.
    shown = render(fetched)
    assert "pool default: admitting 8,000 tokens/s (80% of the configured 10,000), PINNED" in shown
    assert "10,000 -> 8,000" in shown
    assert "P1 tenants (fair shares by tokens):" in shown
    assert re.search(r"^    acme\s+1\s+300\s+300\s+0$", shown, re.MULTILINE), shown
