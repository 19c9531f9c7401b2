"""Envoy's rate limit service (RLS v3) on qosd's port: descriptors and hits map onto
classes, tenants, pools and costs, and the answers carry what Envoy reads."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from qosd.config import ConfigError, load_config
from qosd.v1 import envoy_rls_pb2 as rls
from qosd.v1 import envoy_rls_pb2_grpc
from qosd_harness import RedisServer, daemon_processes
from tests.conftest import DaemonFactory

ROOT = Path(__file__).resolve().parent.parent
ENVOY_METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
OK = rls.RateLimitResponse.OK
OVER_LIMIT = rls.RateLimitResponse.OVER_LIMIT

# P0's bucket: 6,000 tokens/s, burst 3,000 (conftest's BASE_CONFIG); no borrowing.
RLS = {
    "envoy_rls": {
        "domains": ["llm"],
        "class_aliases": {"realtime": "P0", "batch": "P2"},
        "tokens_per_hit": 100,
        "lease_ttl_ms": 300,
    }
}


def _request(domain: str, *descriptors: dict[str, str], hits: int = 0) -> rls.RateLimitRequest:
    request = rls.RateLimitRequest(domain=domain, hits_addend=hits)
    for entries in descriptors:
        descriptor = request.descriptors.add()
        for key, value in entries.items():
            descriptor.entries.add(key=key, value=value)
    return request


class EnvoyCaller:
    """Calls ShouldRateLimit under Envoy's own method path."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._call = self._channel.unary_unary(
            ENVOY_METHOD,
            request_serializer=rls.RateLimitRequest.SerializeToString,
            response_deserializer=rls.RateLimitResponse.FromString,
        )

    async def __call__(self, request: rls.RateLimitRequest) -> rls.RateLimitResponse:
        response: rls.RateLimitResponse = await self._call(request, timeout=5)
        return response

    async def close(self) -> None:
        await self._channel.close()


async def test_descriptors_map_onto_class_tenant_pool_and_cost(
    make_daemon: DaemonFactory,
) -> None:
    running = await make_daemon(RLS)
    call = EnvoyCaller(running.address)
    try:
        # Two descriptors, as two Envoy rate limit actions would send: one map.
        first = await call(
            _request(
                "llm",
                {"qos_class": "realtime", "tenant": "acme"},
                {"model": "llama-3-8b"},
                hits=10,  # 10 hits x 100 tokens = 1,000 of P0's 3,000
            )
        )
        assert first.overall_code == OK
        assert len(first.statuses) == 2
        status = first.statuses[0]
        assert status.code == OK
        assert status.current_limit.name == "default/P0"
        assert status.current_limit.requests_per_unit == 60  # 6,000 tokens/s / 100
        assert status.current_limit.unit == rls.RateLimitResponse.RateLimit.SECOND
        assert 19 <= status.limit_remaining <= 21  # ~2,000 tokens left, in hits

        # A cost entry (a header with the prompt's tokens) wins over hits.
        second = await call(_request("llm", {"qos_class": "P0", "tokens": "1900"}, hits=1))
        assert second.overall_code == OK
        over = await call(_request("llm", {"qos_class": "P0", "tokens": "2500"}))
        assert over.overall_code == OVER_LIMIT
        (status,) = over.statuses
        assert status.code == OVER_LIMIT
        assert status.limit_remaining <= 2
        wait_ms = status.duration_until_reset.ToMilliseconds()
        assert 50 < wait_ms <= 1000  # ~2,400 tokens missing at 6,000/s: ~400 ms
        headers = {h.key: h.value for h in over.response_headers_to_add}
        assert headers == {"retry-after": "1", "x-qosd-reason": "RATE_LIMITED"}
        body = json.loads(over.raw_body)
        assert body["reason"] == "RATE_LIMITED" and body["class"] == "P0"
        assert body["retry_after_ms"] == wait_ms

        # The same budget as Acquire: what Envoy spent, an Acquire cannot have.
        refused = await running.client.acquire("P0", 2_500, model="llama-3-8b")
        assert not refused.admitted
        page = (await running.daemon.metrics_page()).decode()
        assert 'qosd_envoy_rls_requests_total{code="OK",reason="NONE"} 2.0' in page
        assert 'qosd_envoy_rls_requests_total{code="OVER_LIMIT",reason="RATE_LIMITED"} 1.0' in page
    finally:
        await call.close()


async def test_domains_defaults_and_refusals(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"envoy_rls": {**RLS["envoy_rls"], "default_class": "P2"}})
    call = EnvoyCaller(running.address)
    try:
        other = await call(_request("web", {"qos_class": "P0"}, {"path": "/x"}))
        assert other.overall_code == OK and [s.code for s in other.statuses] == [OK, OK]
        assert not other.statuses[0].HasField("current_limit")  # not decided by qosd

        classless = await call(_request("llm", {"tenant": "t"}))
        assert classless.overall_code == OK
        assert classless.statuses[0].current_limit.name == "default/P2"

        for request, words in (
            (_request("llm"), "at least one descriptor"),
            (_request("llm", {}), "descriptors[0]: at least one entry"),
            (_request("llm", {"qos_class": "P0"}, {"tenant": ""}), "descriptors[1]"),
            (_request("llm", {"qos_class": "P7"}), "P7"),
            (_request("llm", {"qos_class": "P0", "tokens": "-5"}), "'tokens'"),
            (_request("llm", {"qos_class": "P0", "tokens": "lots"}), "whole number"),
            (_request("llm", {"qos_class": "P0", "tokens": " 5"}), "whole number"),
            (_request("llm", {"qos_class": "P0", "tokens": "1_000"}), "whole number"),
            (_request("llm", {"qos_class": "P0", "tokens": "\u0665"}), "whole number"),
            (_request("llm", {"qos_class": "P0", "tokens": "+5"}), "whole number"),
            (_request("llm", {"qos_class": "P0", "tokens": str(10**13)}), "from 1 to"),
            (_request("llm", {"qos_class": "P0", "tenant": "t" * 200}), "tenant"),
            (_request("llm", {"qos_class": "P0"}, hits=2**31), "input_tokens"),
        ):
            # Refused, not an error: Envoy admits requests whose rate limit call fails.
            refused = await call(request)
            assert refused.overall_code == OVER_LIMIT
            assert all(status.code == OVER_LIMIT for status in refused.statuses)
            assert len(refused.statuses) == max(1, len(request.descriptors))
            headers = {h.key: h.value for h in refused.response_headers_to_add}
            assert headers == {"x-qosd-reason": "INVALID_REQUEST"}
            assert words in json.loads(refused.raw_body)["message"]
    finally:
        await call.close()


async def test_a_request_that_does_not_decode_is_over_limit(make_daemon: DaemonFactory) -> None:
    """The second probe: a descriptor value that is not UTF-8 (Envoy copies a header's
    raw bytes into it, and obs-text is legal in headers) got INVALID_ARGUMENT, an
    error status Envoy answers by letting the request through. Bytes that are no
    RateLimitRequest are OVER_LIMIT now, saying why, as any request qosd cannot read."""
    running = await make_daemon(RLS)
    sent = _request("llm", {"qos_class": "P1XX"}).SerializeToString()
    raw = sent.replace(b"P1XX", b"P1\xff\xfe")
    async with grpc.aio.insecure_channel(running.address) as channel:
        call = channel.unary_unary(
            ENVOY_METHOD,
            request_serializer=lambda raw: raw,
            response_deserializer=rls.RateLimitResponse.FromString,
        )
        answer: rls.RateLimitResponse = await call(raw, timeout=5)
    assert answer.overall_code == OVER_LIMIT
    assert [(h.key, h.value) for h in answer.response_headers_to_add] == [
        ("x-qosd-reason", "INVALID_REQUEST")
    ]
    assert b"not a valid" in answer.raw_body
    assert (await running.client.status()).pool("default").active_leases == 0


async def test_without_a_default_class_a_classless_request_is_refused(
    make_daemon: DaemonFactory,
) -> None:
    running = await make_daemon(RLS)
    call = EnvoyCaller(running.address)
    try:
        refused = await call(_request("llm", {"tenant": "t"}))
        assert refused.overall_code == OVER_LIMIT
        assert "qos_class" in json.loads(refused.raw_body)["message"]
        # A message that does not decode is OVER_LIMIT too, not an error status,
        # which Envoy would answer by letting the request through.
        channel = grpc.aio.insecure_channel(running.address)
        garbage = channel.unary_unary(
            ENVOY_METHOD, response_deserializer=rls.RateLimitResponse.FromString
        )
        answer: rls.RateLimitResponse = await garbage(b"\xff\xff\xff", timeout=5)
        assert answer.overall_code == OVER_LIMIT
        await channel.close()
    finally:
        await call.close()


async def test_rls_leases_end_on_their_own(make_daemon: DaemonFactory) -> None:
    """No Release in this protocol: the lease lives envoy_rls.lease_ttl_ms (300 ms)."""
    running = await make_daemon(RLS)
    call = EnvoyCaller(running.address)
    try:
        assert (await call(_request("llm", {"qos_class": "P1"}))).overall_code == OK
        leases = (await running.client.status("default")).pool("default").active_leases
        assert leases == 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if (await running.client.status("default")).pool("default").active_leases == 0:
                break
            await asyncio.sleep(0.05)
        assert (await running.client.status("default")).pool("default").active_leases == 0
    finally:
        await call.close()


def test_rls_config_is_checked() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(env={"QOSD_X": "1"}, overrides={("envoy_rls", "default_class"): "P9"})
    assert "envoy_rls.default_class" in str(error.value) and "P9" in str(error.value)
    with pytest.raises(ConfigError) as error:
        load_config(env={}, overrides={("envoy_rls", "class_aliases"): {"rt": "gold"}})
    assert "envoy_rls.class_aliases.rt" in str(error.value)
    with pytest.raises(ConfigError):
        load_config(env={}, overrides={("envoy_rls", "tokens_per_hit"): 0})


async def test_the_rls_can_be_turned_off(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"envoy_rls": {"enabled": False}})
    call = EnvoyCaller(running.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(_request("llm", {"qos_class": "P0"}))
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await call.close()


# -- with Envoy's own generated code, and with grpcurl -------------------------------------


@pytest.fixture(scope="module")
def xds_protos() -> Path:
    """Envoy's generated protos in a folder of their own (see tests/rls/requirements.txt)."""
    requirements = ROOT / "tests" / "rls" / "requirements.txt"
    pinned = next(line.strip() for line in requirements.read_text().splitlines() if "==" in line)
    target = ROOT / ".tools" / pinned.replace("==", "-")
    if not (target / "envoy" / "service" / "ratelimit" / "v3" / "rls_pb2.py").exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
             "--target", str(target), pinned],
            check=True,
        )  # fmt: skip
    return target


def _envoy_client(
    xds: Path, address: str, request: dict[str, Any], count: int = 1
) -> list[dict[str, Any]]:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "rls" / "rls_client.py"), address,
         json.dumps(request), str(count)],
        env={**os.environ, "PYTHONPATH": str(xds)},
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    answers: list[dict[str, Any]] = json.loads(completed.stdout)
    return answers


@pytest.fixture(scope="module")
def rls_daemon(redis_standalone: RedisServer) -> Iterator[str]:
    tree = {
        "redis": {"url": redis_standalone.url, "key_prefix": f"rls{uuid.uuid4().hex[:12]}"},
        "pools": {"llm": {"capacity_tokens_s": 2_000, "models": ["llama"]}},
        "default_pool": "llm",
        "envoy_rls": {"domains": ["gateway"], "default_class": "P1"},
    }
    with daemon_processes(tree) as (daemon,):
        yield daemon.address


def test_a_real_envoy_rls_v3_request(xds_protos: Path, rls_daemon: str) -> None:
    """Envoy's generated stubs, in a process without qosd's code, against a daemon on
    Redis: the wire format is Envoy's, not only the mirror's."""
    # P1 here: 35 % of 2,000 tokens/s with a 0.5 s burst, plus what it may borrow.
    request = {
        "domain": "gateway",
        "descriptors": [
            {"entries": [{"key": "qos_class", "value": "P1"}, {"key": "tenant", "value": "a"}],
             "hits_addend": 300},
            {"entries": [{"key": "model", "value": "llama"}]},
        ],
    }  # fmt: skip
    first, *answers = _envoy_client(xds_protos, rls_daemon, request, count=8)
    assert first["overall_code"] == "OK"
    assert [s["code"] for s in first["statuses"]] == ["OK", "OK"]
    assert first["statuses"][0]["current_limit"]["name"] == "llm/P1"
    assert first["statuses"][0]["current_limit"]["unit"] == "SECOND"
    over = next(a for a in answers if a["overall_code"] == "OVER_LIMIT")
    status = over["statuses"][0]
    assert status["code"] == "OVER_LIMIT"
    assert "limit_remaining" in status
    assert status["duration_until_reset"].endswith("s")
    assert float(status["duration_until_reset"][:-1]) > 0
    headers = {h["key"]: h["value"] for h in over["response_headers_to_add"]}
    assert int(headers["retry-after"]) >= 1
    # Envoy's domain check: another domain is not qosd's to decide.
    (other,) = _envoy_client(xds_protos, rls_daemon, {**request, "domain": "web"})
    assert other["overall_code"] == "OK"
    (bad,) = _envoy_client(
        xds_protos, rls_daemon, {"domain": "gateway", "descriptors": [{"entries": []}]}
    )
    assert bad["overall_code"] == "OVER_LIMIT"
    assert {h["key"]: h["value"] for h in bad["response_headers_to_add"]} == {
        "x-qosd-reason": "INVALID_REQUEST"
    }


def test_grpcurl_calls_the_rls_through_reflection(rls_daemon: str) -> None:
    grpcurl = Path(sys.executable).parent / "grpcurl"
    listed = subprocess.run(
        [str(grpcurl), "-plaintext", rls_daemon, "list"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.split()  # fmt: skip
    assert "qosd.v1.envoy_rls.RateLimitService" in listed
    body = json.dumps(
        {"domain": "gateway", "descriptors": [{"entries": [{"key": "tokens", "value": "10"}]}]}
    )
    answer = subprocess.run(
        [str(grpcurl), "-plaintext", "-d", body, rls_daemon,
         "qosd.v1.envoy_rls.RateLimitService/ShouldRateLimit"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    response = json_format.Parse(answer, rls.RateLimitResponse())
    assert response.overall_code == OK
    assert response.statuses[0].current_limit.name == "llm/P1"


async def test_the_mirror_stub_works_too(make_daemon: DaemonFactory) -> None:
    """qosd's own generated stub (the mirror's service name) reaches the same handler."""
    running = await make_daemon(RLS)
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = envoy_rls_pb2_grpc.RateLimitServiceStub(channel)
        response = await stub.ShouldRateLimit(_request("llm", {"qos_class": "P1"}), timeout=5)
    assert response.overall_code == OK
    assert json_format.MessageToDict(response)["overallCode"] == "OK"
