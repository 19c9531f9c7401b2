"""Servers' own load (ReportRequest.loads): a GPU-gated pool stops admitting the
classes below the top one while its servers, by their own latest reads, hold more
waiting requests than ``max_server_waiting`` or a KV cache at or above
``max_kv_cache_usage``. Over gRPC, on the embedded store, a standalone Redis and a
3-node cluster.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from qosd_client import InvalidRequest, QosdClient, Reason, ServerLoad
from qosd_client.server_load import ModelLoad, parse_server_load, server_loads
from tests.conftest import DaemonFactory

MODEL = "llama-3-8b"
POOL: dict[str, Any] = {
    "max_in_flight": 100,
    "max_server_waiting": 2,
    "max_kv_cache_usage": 0.9,
    "server_load_max_age_ms": 500,
}


async def _loads(qos: QosdClient, *loads: ServerLoad) -> None:
    result = await qos.report([], loads=loads)
    assert result.loads_accepted == len(loads) and not result.loads_rejected


async def test_servers_past_their_load_stop_the_lower_classes(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"pools": {"default": POOL}})).client
    # Something in flight: a request alone in an idle pool always fits.
    assert (await qos.acquire("P2", 10, model=MODEL, max_wait_ms=0)).admitted
    await _loads(
        qos,
        ServerLoad(MODEL, "triton-0", waiting_requests=2),
        ServerLoad(MODEL, "triton-1", waiting_requests=1),
    )
    status = (await qos.status()).pool("default")
    assert status.server_waiting_requests == 3 and status.server_kv_cache_usage is None
    refused = await qos.acquire("P1", 10, model=MODEL, max_wait_ms=0)
    assert not refused.admitted and refused.reason is Reason.RATE_LIMITED
    # The top class is not held back: its requests would wait at least as long here.
    assert (await qos.acquire("P0", 10, model=MODEL, max_wait_ms=0)).admitted
    # A server's new read replaces its last: 2 waiting in all is within the limit.
    await _loads(qos, ServerLoad(MODEL, "triton-1", waiting_requests=0))
    assert (await qos.acquire("P1", 10, model=MODEL, max_wait_ms=0)).admitted
    # The KV cache: the fullest server counts.
    await _loads(qos, ServerLoad(MODEL, "triton-0", waiting_requests=0, kv_cache_usage=0.95))
    status = (await qos.status()).pool("default")
    assert status.server_waiting_requests == 0
    assert status.server_kv_cache_usage == pytest.approx(0.95)
    assert not (await qos.acquire("P2", 10, model=MODEL, max_wait_ms=0)).admitted
    assert (await qos.acquire("P0", 10, model=MODEL, max_wait_ms=0)).admitted


async def test_a_waiter_is_admitted_when_the_servers_catch_up(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"pools": {"default": POOL}})).client
    assert (await qos.acquire("P2", 10, model=MODEL, max_wait_ms=0)).admitted
    await _loads(qos, ServerLoad(MODEL, "vllm-0", waiting_requests=5))
    waiter = asyncio.create_task(qos.acquire("P1", 10, model=MODEL, max_wait_ms=5_000))
    deadline = time.monotonic() + 5.0
    while (await qos.status()).pool("default").cls("P1").waiting != 1:
        assert time.monotonic() < deadline, "the P1 request never waited"
        await asyncio.sleep(0.01)
    await _loads(qos, ServerLoad(MODEL, "vllm-0", waiting_requests=0))
    assert (await waiter).admitted


async def test_a_server_that_stops_reporting_stops_counting(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"pools": {"default": POOL}})).client
    assert (await qos.acquire("P2", 10, model=MODEL, max_wait_ms=0)).admitted
    await _loads(qos, ServerLoad(MODEL, "vllm-0", waiting_requests=5))
    assert not (await qos.acquire("P1", 10, model=MODEL, max_wait_ms=0)).admitted
    # Once its read is older than server_load_max_age_ms (0.5 s) it no longer counts,
    # in status and in admission.
    deadline = time.monotonic() + 5.0
    while (await qos.status()).pool("default").server_waiting_requests is not None:
        assert time.monotonic() < deadline, "a stale read still counted"
        await asyncio.sleep(0.05)
    assert (await qos.acquire("P1", 10, model=MODEL, max_wait_ms=0)).admitted
    # Nor in the sum when another server reports.
    await _loads(qos, ServerLoad(MODEL, "vllm-1", waiting_requests=1))
    assert (await qos.status()).pool("default").server_waiting_requests == 1
    assert (await qos.acquire("P1", 10, model=MODEL, max_wait_ms=0)).admitted


async def test_loads_are_validated_naming_the_field(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"pools": {"default": POOL}})).client
    result = await qos.report(
        [],
        loads=[
            ServerLoad(MODEL, "", waiting_requests=1),
            ServerLoad(MODEL, "a", waiting_requests=-1),
            ServerLoad(MODEL, "b", kv_cache_usage=1.5),
            ServerLoad(MODEL, "c" * 300, waiting_requests=1),
            ServerLoad(MODEL, "d", waiting_requests=1, kv_cache_usage=0.5),
        ],
    )
    assert result.loads_accepted == 1
    reasons = dict(result.loads_rejected)
    assert sorted(reasons) == [0, 1, 2, 3]
    assert "server is required" in reasons[0]
    assert "waiting_requests" in reasons[1] and "kv_cache_usage" in reasons[2]
    assert reasons[3].startswith("server is 300 characters long")
    with pytest.raises(InvalidRequest, match="at least one sample"):
        await qos.report([])


async def test_a_pool_without_limits_ignores_loads(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"pools": {"default": {"max_in_flight": 100}}})).client
    assert (await qos.acquire("P2", 10, model=MODEL, max_wait_ms=0)).admitted
    await _loads(qos, ServerLoad(MODEL, "triton-0", waiting_requests=50, kv_cache_usage=1.0))
    assert (await qos.status()).pool("default").server_waiting_requests == 50  # still shown
    assert (await qos.acquire("P1", 10, model=MODEL, max_wait_ms=0)).admitted


TRITON = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="llm",version="1"} 3
nv_inference_pending_request_count{model="llm",version="2"} 2
nv_inference_pending_request_count{model="embed",version="1"} 0
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="llm",version="1"} 40
"""
VLLM = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.93
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="older"} 0.5
"""


def test_gauges_are_read_from_triton_and_vllm_metrics() -> None:
    assert parse_server_load(TRITON) == {  # versions summed
        "llm": ModelLoad(waiting=5),
        "embed": ModelLoad(waiting=0),
    }
    assert parse_server_load(VLLM) == {
        "meta-llama/Llama-3.1-8B": ModelLoad(waiting=7, kv_usage=0.93),
        "older": ModelLoad(kv_usage=0.5),  # the older name; no waiting gauge: unknown, not 0
    }
    assert parse_server_load("# nothing here\n") == {}
    assert server_loads(TRITON, "triton-0") == [
        ServerLoad("embed", "triton-0", waiting_requests=0),
        ServerLoad("llm", "triton-0", waiting_requests=5),
    ]
